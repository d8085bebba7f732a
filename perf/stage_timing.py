# Per-stage step times of the runners in-process (no Triton), on the full-size config with dummy weights:
# thinker prefill and decode, talker frame (code predictor + talker step), code2wav 25-frame chunk, at
# several batch sizes. Where the time goes, stage by stage. Writes JSON to argv[1].
#
#   python -m perf.stage_timing out.json [--config perf/qwen3_omni_30b_a3b_instruct.config.json]
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Sequence, SeqStatus
from omnistage.models.checkpoint import load_config, load_stage
from omnistage.stages.code2wav import Code2WavRunner
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import TalkerConditioning, ThinkerPrompt, ThinkerRunner

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
    args = ap.parse_args()
    source, dev, dtype = f"dummy:{args.config}", torch.device("cuda", 0), torch.bfloat16
    config = load_config(source)
    report = {"weights": "dummy random bf16", "model": "full-size Qwen3-Omni-30B-A3B config", "eager": True,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "prompt_tokens": args.prompt}  # fmt: skip
    kw = dict(max_slots=max(BATCHES), max_seq_len=1024, device=dev, dtype=dtype)
    long = SamplingParams(max_tokens=500, ignore_eos=True)

    thinker_times(report, source, config, dev, dtype, kw, long, args.prompt)
    free()
    talker_times(report, source, config, dev, dtype, kw, long, args.prompt)
    free()
    code2wav_times(report, source, dev, dtype)
    report["gpu_mem_gb_peak"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(report, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def thinker_times(report, source, config, dev, dtype, kw, params, prompt) -> None:
    t0 = time.perf_counter()
    thinker = load_stage(source, "thinker", dtype, dev, experts_implementation="grouped_mm")
    report["thinker_load_s"] = round(time.perf_counter() - t0, 2)
    runner = ThinkerRunner(thinker, config, **kw)
    ids = torch.randint(0, 150000, (prompt,), generator=torch.Generator().manual_seed(0))
    ids[-3:] = torch.tensor([config.im_start_token_id, config.assistant_token_id, 198])  # "<|im_start|>assistant\n"
    seqs = [running(i, params, ThinkerPrompt(ids, export_talker=True)) for i in range(max(BATCHES))]
    report["thinker_prefill_ms"] = timed(lambda: runner.prefill(seqs[:1]), repeat=2)
    for s in seqs:
        runner.prefill([s])
    report["thinker_decode_ms"] = {b: timed(lambda b=b: runner.decode(seqs[:b])) for b in BATCHES}
    report["gpu_mem_gb_thinker"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(report), flush=True)


def talker_times(report, source, config, dev, dtype, kw, params, prompt) -> None:
    talker = load_stage(source, "talker", dtype, dev, experts_implementation="grouped_mm")
    runner = TalkerRunner(talker, config, **kw)
    g = torch.Generator().manual_seed(1)
    d = config.thinker_config.text_config.hidden_size
    cond = TalkerConditioning(torch.randn(prompt - 10, d, generator=g) * 0.02,
                              torch.zeros(prompt - 10, dtype=torch.bool),
                              torch.randint(0, 150000, (prompt - 10,), generator=g), torch.randn(6, d, generator=g) * 0.02)  # fmt: skip
    rows = list((torch.randn(20, d, generator=g) * 0.02).unbind(0))
    seqs = [running(i, params, TalkerPrompt(cond, 2302, list(rows), True)) for i in range(max(BATCHES))]
    report["talker_prefill_ms"] = timed(lambda: runner.prefill(seqs[:1]), repeat=2)
    for s in seqs:
        runner.prefill([s])
    report["talker_frame_ms"] = {b: timed(lambda b=b: runner.decode(seqs[:b])) for b in BATCHES}
    hidden, c0 = runner.hidden[: max(BATCHES)], torch.zeros(max(BATCHES), dtype=torch.long, device=dev)
    report["code_predictor_15_steps_ms"] = {
        b: timed(lambda b=b: runner.predictor(hidden[:b], c0[:b], lambda step, logits: logits.argmax(-1))) for b in BATCHES
    }
    print(json.dumps(report), flush=True)


def code2wav_times(report, source, dev, dtype) -> None:
    c2w = Code2WavRunner(load_stage(source, "code2wav", dtype, dev), dev, dtype)
    first = c2w.decode([(torch.zeros(4, 16, dtype=torch.long, device=dev), None)])[0][1]
    state = c2w.decode([(torch.zeros(25, 16, dtype=torch.long, device=dev), first)])[0][1]
    chunk = torch.randint(0, 2048, (25, 16), device=dev)
    report["code2wav_chunk25_ms"] = {b: timed(lambda b=b: c2w.decode([(chunk, state)] * b)) for b in BATCHES}


if __name__ == "__main__":
    main()
