# Per-stage step times of the runners in-process (no Triton), on the full-size config with dummy weights,
# eager and with CUDA graphs (and whether both pick the same greedy tokens from the same state):
# thinker prefill and decode, talker frame (code predictor + talker step), code2wav 25-frame chunk, at
# several batch sizes. Where the time goes, stage by stage. Writes JSON to argv[1].
#
#   python -m perf.stage_timing out.json [--config perf/qwen3_omni_30b_a3b_instruct.config.json] [--fused]
#                                        [--stages thinker talker code2wav]
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import SeqStatus, Sequence
from omnistage.models import fused_ops
from omnistage.models.checkpoint import load_config, load_stage, load_text_embeddings
from omnistage.models.fused import install as fused_install
from omnistage.stages.code2wav import Code2WavRunner
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.conditioning import TalkerConditioning
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

BATCHES = (1, 16, 64)


def running(i, params, payload):
    seq = Sequence(f"r{i}", params, payload, slot=i)
    seq.status = SeqStatus.RUNNING
    return seq


def timed(fn, repeat=3):
    fn()  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / repeat * 1e3, 2)


def free():
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="perf/qwen3_omni_30b_a3b_instruct.config.json")
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--experts", default="grouped_mm", help="experts_implementation, e.g. gather_or_grouped")
    ap.add_argument("--fused", action="store_true", help="graphed runs with the served fused kernels")
    ap.add_argument("--stages", nargs="+", default=["thinker", "talker", "code2wav"])
    args = ap.parse_args()
    source, dev, dtype = f"dummy:{args.config}", torch.device("cuda", 0), torch.bfloat16
    config = load_config(source)
    report = {"weights": "dummy random bf16", "model": "full-size Qwen3-Omni-30B-A3B config",
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "prompt_tokens": args.prompt}  # fmt: skip
    kw = dict(max_slots=max(BATCHES), max_seq_len=1024, device=dev, dtype=dtype)
    long = SamplingParams(max_tokens=500, ignore_eos=True)

    report["experts_implementation"], report["graphs_fused"] = args.experts, args.fused
    if "thinker" in args.stages:
        thinker_times(report, source, config, dev, dtype, kw, long, args.prompt, args.experts, args.fused)
        free()
    if "talker" in args.stages:
        talker_times(report, source, config, dev, dtype, kw, long, args.prompt, args.experts, args.fused)
        free()
    if "code2wav" in args.stages:
        code2wav_times(report, source, dev, dtype)
    report["gpu_mem_gb_peak"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(report, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def greedy_agreement(eager_steps, graph_steps) -> float:
    """Fraction of equal greedy picks between two runs that started from the same state."""
    pairs = [(a, b) for ea, gb in zip(eager_steps, graph_steps) for a, b in zip(ea, gb)]
    return round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 4)


def served_kernels(model, fused: bool) -> None:
    """With --fused, the graphed runs also use the served kernels (fused_kernels: fused ops and merged
    projections), so the agreement compares transformers' eager ops with what the server runs."""
    if fused:
        fused_install(model)


def thinker_times(report, source, config, dev, dtype, kw, params, prompt, experts, fused=False) -> None:
    t0 = time.perf_counter()
    thinker = load_stage(source, "thinker", dtype, dev, experts_implementation=experts)
    report["thinker_load_s"] = round(time.perf_counter() - t0, 2)
    prompts = thinker_prompts(config, prompt, max(BATCHES), export_talker=True)
    picks = {"eager": thinker_mode(report, "eager", thinker, config, kw, params, prompts)}
    served_kernels(thinker, fused)
    picks["graphs"] = thinker_mode(report, "graphs", thinker, config, kw, params, prompts)
    report["thinker_graph_eager_greedy_agreement"] = greedy_agreement(picks["eager"], picks["graphs"])
    report["gpu_mem_gb_thinker"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(report), flush=True)


def talker_times(report, source, config, dev, dtype, kw, params, prompt, experts, fused=False) -> None:
    talker = load_stage(source, "talker", dtype, dev, experts_implementation=experts)
    prompts = talker_prompts(config, prompt, max(BATCHES))
    # the fused rope is installed process-wide (the thinker's run may have done it): transformers' own here
    fused_ops.modeling.apply_rotary_pos_emb = fused_ops._original_rope
    table = load_text_embeddings(source, dtype, dev)
    picks = {"eager": talker_mode(report, "eager", talker, table, config, kw, params, prompts, dev)}
    served_kernels(talker, fused)
    picks["graphs"] = talker_mode(report, "graphs", talker, table, config, kw, params, prompts, dev)
    report["talker_graph_eager_greedy_agreement"] = greedy_agreement(picks["eager"], picks["graphs"])
    print(json.dumps(report), flush=True)


def thinker_prompts(config, prompt: int, n: int, export_talker: bool = False) -> list[ThinkerPrompt]:
    """n text prompts of `prompt` random tokens ending in "<|im_start|>assistant\n", each with its own first
    token (so no two share a prefix)."""
    ids = torch.randint(0, 150000, (prompt,), generator=torch.Generator().manual_seed(0))
    ids[-3:] = torch.tensor([config.im_start_token_id, config.assistant_token_id, 198])
    return [ThinkerPrompt(torch.cat([ids[:1] + i, ids[1:]]), export_talker=export_talker) for i in range(n)]


def talker_prompts(config, prompt: int, n: int) -> list[TalkerPrompt]:
    """n copies of a talker prompt as the thinker hands it over: conditioning of a prompt-token turn, 20 rows."""
    g = torch.Generator().manual_seed(1)
    d = config.thinker_config.text_config.hidden_size
    cond = TalkerConditioning(torch.zeros(0, d), torch.zeros(prompt - 10, dtype=torch.bool),
                              torch.randint(0, 150000, (prompt - 10,), generator=g), torch.randn(6, d, generator=g) * 0.02)  # fmt: skip
    rows = list((torch.randn(20, d, generator=g) * 0.02).unbind(0))
    return [TalkerPrompt(cond, 2302, list(rows), True) for _ in range(n)]


def thinker_mode(report, mode, thinker, config, kw, params, prompts) -> list[list[int]]:
    runner = ThinkerRunner(thinker, config, **kw, cuda_graphs=mode == "graphs")
    t0 = time.perf_counter()
    runner.capture_graphs()
    report[f"thinker_capture_s_{mode}"] = round(time.perf_counter() - t0, 2)
    seqs = [running(i, params, p) for i, p in enumerate(prompts)]
    report[f"thinker_prefill_ms_{mode}"] = timed(lambda: runner.prefill(seqs[:1]), repeat=2)
    report[f"thinker_prefill8_ms_{mode}"] = timed(lambda: runner.prefill(seqs[:8]), repeat=2)  # one batched forward
    release(runner, seqs)
    pick = lambda results: [r.output.token_ids[0] for r in results]
    report[f"thinker_decode_ms_{mode}"], picks = decode_times(runner, seqs, 8, pick)
    return picks


def release(runner, seqs) -> None:
    for seq in seqs:
        runner.release(seq)


def decode_times(runner, seqs, prefill_group: int, pick=None, measure=timed, batches=BATCHES) -> tuple[dict, list]:
    """measure(step) at each batch size b with exactly b slots occupied: a step runs every occupied row up
    to the highest one, so b must not share the runner with more prefilled slots. Also, with `pick`, the
    picks of 4 steps at 16 (what the greedy-agreement check compares between eager and graphs)."""
    times, picks, done = {}, [], 0
    for b in sorted(batches):
        for i in range(done, b, prefill_group):
            runner.prefill(seqs[i : min(b, i + prefill_group)])
        done = b
        if b == 16 and pick is not None:
            picks = [pick(runner.decode(seqs[:16])) for _ in range(4)]
        times[b] = measure(lambda b=b: runner.decode(seqs[:b]))
    return times, picks


def talker_mode(report, mode, talker, text_embeddings, config, kw, params, prompts, dev) -> list[list[int]]:
    n = len(prompts)
    runner = TalkerRunner(talker, config, text_embeddings, **kw, cuda_graphs=mode == "graphs")
    t0 = time.perf_counter()
    runner.capture_graphs()
    report[f"talker_capture_s_{mode}"] = round(time.perf_counter() - t0, 2)
    seqs = [running(i, params, p) for i, p in enumerate(prompts)]
    report[f"talker_prefill_ms_{mode}"] = timed(lambda: runner.prefill(seqs[:1]), repeat=2)
    release(runner, seqs)
    pick = lambda results: [r.seq.generated[-1] for r in results]
    report[f"talker_frame_ms_{mode}"], picks = decode_times(runner, seqs, 8, pick)
    hidden, c0 = runner.hidden[:n], torch.zeros(n, dtype=torch.long, device=dev)
    if runner.static_predictor is not None:

        def predict(b):
            return runner.static_predictor(hidden[:b], c0[:b], [True] * b)
    else:

        def predict(b):
            return runner.predictor(hidden[:b], c0[:b], lambda step, logits: logits.argmax(-1))

    report[f"code_predictor_15_steps_ms_{mode}"] = {b: timed(lambda b=b: predict(b)) for b in BATCHES}
    return picks


def code2wav_times(report, source, dev, dtype) -> None:
    c2w = Code2WavRunner(load_stage(source, "code2wav", dtype, dev), dev, dtype)
    first = c2w.decode([(torch.zeros(4, 16, dtype=torch.long, device=dev), None)])[0][1]
    state = c2w.decode([(torch.zeros(25, 16, dtype=torch.long, device=dev), first)])[0][1]
    chunk = torch.randint(0, 2048, (25, 16), device=dev)
    report["code2wav_chunk25_ms"] = {b: timed(lambda b=b: c2w.decode([(chunk, state)] * b)) for b in BATCHES}


if __name__ == "__main__":
    main()
