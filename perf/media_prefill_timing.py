# Thinker prefill of W3 (5 s speech clip + instruction) and W4 (448x448 image + question) prompts in-process
# (no Triton), full-size config with dummy bf16 weights: each prompt alone through transformers' thinker
# forward against one batched media prefill step (stages/media_prefill.py), eager and with CUDA graphs, at several prompt counts;
# the encoders alone, transformers per item against one batched call; and whether the batched step picks
# the per-request path's first tokens. With --w5: W5 prompts (a 10 s video with its audio track, ~1550
# tokens, longer than a static prefill row) as the served thinker takes them whole in one step (graphs
# captured): the step's encoders alone, the whole step, and the step's kernel time beside its wall time
# (wall far above kernels: the step is host-bound). Writes JSON to argv[1].
#
#   source .carry/device/env.sh && python -m perf.media_prefill_timing $OUT/media_prefill.json
#   python -m perf.media_prefill_timing $OUT/w5_prefill.json --w5
#   python -m perf.media_prefill_timing /tmp/m.json --config tiny --device cpu [--w5]   (a CPU check of the script)
from __future__ import annotations

import argparse
import json
import time

import torch

from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import SeqStatus, Sequence
from omnistage.models.checkpoint import load_config, load_stage
from omnistage.models.fused import install as fused_install
from omnistage.models.pixels import scale_pixels
from omnistage.models.processor import load_pixel_table, load_processor, prepare_inputs
from omnistage.stages.audio_encoder import AudioEncoder
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner
from omnistage.stages.vision_encoder import VisionEncoder
from perf.media_workloads import image_prompts, video_prompts, voice_chat_prompts
from perf.profile_steps import top_kernels

COUNTS = (1, 4, 16)

PIXEL_TABLE = load_pixel_table("dummy:")  # transformers' forward takes the processor's floats


def timed(fn, device, repeat=3) -> float:
    """Mean ms of fn() after one warm-up call (which also captures any graph it needs)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return round((time.perf_counter() - t0) / repeat * 1e3, 3)


def sequences(prompts: list[ThinkerPrompt]) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"r{i}", SamplingParams(max_tokens=18, ignore_eos=True), p, slot=i)
        seq.status = SeqStatus.RUNNING
        seqs.append(seq)
    return seqs


def first_tokens(runner: ThinkerRunner, prompts: list[ThinkerPrompt], batched: bool) -> list[int]:
    """Each prompt's greedy first token: batched, from one runner prefill step; else from transformers'
    thinker forward over each prompt alone."""
    if not batched:
        return [transformers_first_token(runner.model, p, runner.device) for p in prompts]
    seqs = sequences(prompts)
    results = runner.prefill(seqs)
    for s in seqs:
        runner.release(s)
    return [r.output.token_ids[0] for r in results]


@torch.inference_mode()
def transformers_first_token(thinker, p: ThinkerPrompt, device) -> int:
    dtype = thinker.dtype
    move = lambda t, cast=False: None if t is None else t.to(device, dtype) if cast else t.to(device)  # noqa: E731
    ids = move(p.input_ids)[None]
    pixels = None if p.pixel_values is None else scale_pixels(p.pixel_values, PIXEL_TABLE)
    logits = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=move(pixels, True),
                     image_grid_thw=move(p.image_grid_thw), input_features=move(p.input_features, True),
                     feature_attention_mask=move(p.feature_attention_mask)).logits  # fmt: skip
    return int(logits[0, -1].argmax())


def thinker_prompt(x: dict, use_audio_in_video: bool = False) -> ThinkerPrompt:
    return ThinkerPrompt(x["input_ids"][0], x.get("pixel_values"), x.get("image_grid_thw"), x.get("input_features"),
                         x.get("feature_attention_mask"), export_talker=True,
                         pixel_values_videos=x.get("pixel_values_videos"), video_grid_thw=x.get("video_grid_thw"),
                         video_second_per_grid=x.get("video_second_per_grid"), use_audio_in_video=use_audio_in_video)  # fmt: skip


def w5_times(report: dict, runner: ThinkerRunner, prompts: list[ThinkerPrompt], device) -> None:
    """The served thinker's step over n whole W5 prompts (graphs captured): the encoders' part of it
    (MediaInputs.rows), the whole step, and the step's kernel time with its top kernels."""
    for n in COUNTS:
        ps = prompts[:n]
        for s in sequences(ps):
            runner.validate(s)  # MRoPE positions and digests, as admission derives them
        report[f"w5_encoders_ms_{n}"] = timed(lambda: runner.media.rows(ps, [0] * n), device)
        report[f"w5_step_ms_{n}"] = timed(lambda: first_tokens(runner, ps, True), device)
        if device.type == "cuda":
            kernels = top_kernels(lambda: first_tokens(runner, ps, True), 10)
            report[f"w5_step_kernel_ms_{n}"], report[f"w5_step_top_kernels_{n}"] = kernels["cuda_ms"], kernels["top"]
        print(json.dumps(report), flush=True)


def encoder_times(report: dict, name: str, thinker, inputs: list[dict], device) -> None:
    if "input_features" in inputs[0]:
        clips = [x["input_features"][0][:, : int(x["feature_attention_mask"].sum())] for x in inputs]
        batched = AudioEncoder(thinker.audio_tower)
        dtype = thinker.audio_tower.conv2d1.weight.dtype
        per_item = [(c.to(device, dtype), torch.tensor([c.shape[1]], device=device)) for c in clips]
        report[f"{name}_encoder_per_item_ms"] = timed(lambda: [thinker.audio_tower(c, feature_lens=n) for c, n in per_item], device)
        report[f"{name}_encoder_batched_ms"] = timed(lambda: batched(clips), device)
    else:
        images = [(x["pixel_values"], x["image_grid_thw"]) for x in inputs]
        batched = VisionEncoder(thinker.visual, PIXEL_TABLE)
        pixels, grids = torch.cat([p for p, _ in images]), torch.cat([g for _, g in images])
        dtype = thinker.visual.patch_embed.proj.weight.dtype
        per_item = [(scale_pixels(p, PIXEL_TABLE).to(device, dtype), g.to(device)) for p, g in images]
        report[f"{name}_encoder_per_item_ms"] = timed(lambda: [thinker.visual(p, grid_thw=g) for p, g in per_item], device)
        report[f"{name}_encoder_batched_ms"] = timed(lambda: batched(pixels, grids), device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="perf/qwen3_omni_30b_a3b_instruct.config.json", help="a config.json, or tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", default="gather_or_grouped", help="experts_implementation")
    ap.add_argument("--w5", action="store_true", help="W5 alone: the served step over whole W5 prompts")
    args = ap.parse_args()
    source, device = f"dummy:{args.config}", torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = load_config(source)
    processor = load_processor(source)
    report = {"weights": f"dummy random {dtype}", "config": args.config, "experts_implementation": args.experts,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__}  # fmt: skip
    thinker = load_stage(source, "thinker", dtype, device, experts_implementation=args.experts)
    if args.w5:
        inputs = [prepare_inputs(processor, c, use_audio_in_video=True) for c in video_prompts(max(COUNTS))]
        report["w5_prompt_tokens"] = int(inputs[0]["input_ids"].shape[1])
        if device.type == "cuda":
            fused_install(thinker)
        runner = ThinkerRunner(thinker, config, max_slots=max(COUNTS), max_seq_len=2048, device=device, dtype=dtype,
                               max_prefills=max(COUNTS), cuda_graphs=device.type == "cuda")  # fmt: skip
        runner.capture_graphs()
        w5_times(report, runner, [thinker_prompt(x, use_audio_in_video=True) for x in inputs], device)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    prompts = {}
    for name, conversations in (("w3", voice_chat_prompts(max(COUNTS))), ("w4", image_prompts(max(COUNTS)))):
        inputs = [prepare_inputs(processor, c) for c in conversations]
        report[f"{name}_prompt_tokens"] = int(inputs[0]["input_ids"].shape[1])
        prompts[name] = [thinker_prompt(x) for x in inputs]
        encoder_times(report, name, thinker, inputs, device)
    kw = dict(max_slots=max(COUNTS), max_seq_len=1024, device=device, dtype=dtype, max_prefills=max(COUNTS))
    for graphs in (False, True):
        mode = "graphs" if graphs else "eager"
        if graphs:
            fused_install(thinker)  # the served kernels, as the graphed server runs them
        runner = ThinkerRunner(thinker, config, cuda_graphs=graphs, **kw)
        for name, ps in prompts.items():
            for n in COUNTS:
                report[f"{name}_{mode}_batched_prefill_ms_{n}"] = timed(lambda: first_tokens(runner, ps[:n], True), device)
                if not graphs:  # transformers' forward, one prompt after another
                    report[f"{name}_per_request_prefill_ms_{n}"] = timed(lambda: first_tokens(runner, ps[:n], False), device)
            report[f"{name}_{mode}_first_tokens_agree"] = first_tokens(runner, ps, True) == first_tokens(runner, ps, False)
            print(json.dumps(report), flush=True)
        del runner
    if device.type == "cuda":
        report["gpu_mem_gb_peak"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
