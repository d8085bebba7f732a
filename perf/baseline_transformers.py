# The baseline: transformers' own Qwen3OmniMoeForConditionalGeneration.generate() on the same weights
# as the server (each stage built by omnistage.models.checkpoint.load_stage, so a dummy source gives the
# very tensors the server draws), W1 lengths, greedy, speaker ethan. Non-streaming: the first packet
# arrives with the last, so TTFT = TTFP = E2E and RTF = E2E / audio seconds. Metric names as perf.loadgen.
#   batch 1 : a few requests one after another (per-request latency)
#   batch B : one batched generate() of B prompts (requests / s)
#
#   python -m perf.baseline_transformers --model checkpoints/tiny --device cpu --batch 1 4 --out base.json
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from perf import workloads
from perf.metrics import LevelResult, RequestRecord


def build_model(source: str, device: str, dtype: torch.dtype, experts_implementation: str | None, seed: int = 0):
    """The whole model as the server's stages: meta skeleton, then each stage from load_stage (weights
    drawn or read straight on `device`, never a full-size copy on the CPU)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.checkpoint import STAGES, load_config, load_stage
    from omnistage.models.skeleton import build_on_meta

    config = load_config(source)
    model = build_on_meta(
        Qwen3OmniMoeForConditionalGeneration, config, dtype, experts_implementation=experts_implementation
    )
    for stage in STAGES:
        setattr(
            model, stage, load_stage(source, stage, dtype, device, seed, experts_implementation=experts_implementation)
        )
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on meta after loading the stages: {left[:5]}")
    return model.eval().requires_grad_(False)


def resolve_experts(choice: str, device: str) -> str | None:
    # grouped_mm: transformers' grouped-GEMM experts (what the server runs on cuda); the default is a
    # per-expert Python loop. On CPU the default is used (grouped_mm targets CUDA).
    if choice == "auto":
        return "grouped_mm" if device == "cuda" else None
    return None if choice == "default" else choice


class Generator:
    def __init__(self, model, processor, device: str, speaker: str = "ethan"):
        self.model, self.processor, self.device, self.speaker = model, processor, device, speaker
        self.processor.tokenizer.padding_side = "left"  # batched generate() assumes aligned assistant turns

    def inputs(self, prompts: list[list[dict]]) -> dict:
        tok = self.processor.tokenizer
        texts = [
            tok.apply_chat_template(
                m, chat_template=self.processor.chat_template, add_generation_prompt=True, tokenize=False
            )
            for m in prompts
        ]
        batch = tok(texts, return_tensors="pt", padding=True)
        return {
            "input_ids": batch["input_ids"].to(self.device),
            "attention_mask": batch["attention_mask"].to(self.device),
        }

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(self, prompts: list[list[dict]], reply_tokens: int, frames: int) -> tuple[float, list[int]]:
        """One generate() over the prompts; returns (seconds, audio samples per prompt)."""
        from omnistage.models.hf_compat import talker_audio_config_patch

        inputs = self.inputs(prompts)
        # generate()'s off-by-ones (tests/oracle.py): N+1 thinker tokens speak N; F+1 talker steps give F
        # frames. min_new_tokens suppresses EOS so random weights run the full lengths, as ignore_eos does.
        kw = {
            "speaker": self.speaker,
            "thinker_max_new_tokens": reply_tokens + 1,
            "thinker_min_new_tokens": reply_tokens + 1,
            "thinker_do_sample": False,
            "talker_max_new_tokens": frames + 1,
            "talker_min_new_tokens": frames + 1,
            "talker_do_sample": False,
        }
        self.sync()
        t0 = time.perf_counter()
        with talker_audio_config_patch(self.model), torch.no_grad():
            _, wavs = self.model.generate(**inputs, **kw)
        self.sync()
        elapsed = time.perf_counter() - t0
        wavs = [wavs] if torch.is_tensor(wavs) else list(wavs)
        return elapsed, [int(w.numel()) for w in wavs]


def run_batch(gen: Generator, workload: workloads.Workload, batch: int, requests: int, offset: int) -> LevelResult:
    """batch 1: `requests` generate() calls in a row; batch B: one generate() of B prompts."""
    records, wall = [], 0.0
    calls = requests if batch == 1 else 1
    for call in range(calls):
        idx = [offset + call * batch + i for i in range(batch)]
        prompts = [workload.prompts[i % len(workload.prompts)] for i in idx]
        elapsed, samples = gen.run(prompts, workload.reply_tokens, workload.frames)
        wall += elapsed
        for i, n in zip(idx, samples):
            r = RequestRecord(
                index=i,
                ttft=elapsed,
                ttfp=elapsed,
                last_audio=elapsed,
                e2e=elapsed,
                audio_samples=n,
                completion_tokens=workload.reply_tokens,
                status="ok",
            )
            records.append(r)
        print(
            f"[baseline] batch {batch}: generate() {call + 1}/{calls} took {elapsed:.2f}s, "
            f"{samples[0] / 24000:.2f}s audio per request",
            file=sys.stderr,
            flush=True,
        )
    return LevelResult(batch, len(records), wall, records, note="non-streaming: TTFT = TTFP = E2E")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m perf.baseline_transformers", description="transformers generate() baseline"
    )
    ap.add_argument("--model", required=True, help="checkpoint dir, or dummy:<config.json>")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu (as the server)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests", type=int, default=3, help="sequential requests at batch 1")
    ap.add_argument("--reply-tokens", type=int, default=18)
    ap.add_argument("--frames", type=int, default=46)
    ap.add_argument("--warmup", type=int, default=1, help="generate() calls at full length first (kernels, allocator)")
    ap.add_argument(
        "--experts-implementation", default="auto", help="auto | grouped_mm | default | <transformers name>"
    )
    ap.add_argument("--seed", type=int, default=0, help="dummy-weight seed (the server uses 0)")
    ap.add_argument("--time-budget", type=float, help="seconds; a batch size not started by then is skipped")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    experts = resolve_experts(args.experts_implementation, args.device.split(":")[0])
    workload = workloads.w1(max(64, max(args.batch) + args.requests + args.warmup)).with_lengths(
        args.reply_tokens, args.frames
    )
    import transformers

    result = {
        "tool": "perf.baseline_transformers",
        "model": args.model,
        "device": args.device,
        "dtype": str(dtype),
        "experts_implementation": experts or "default",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "workload": workload.params(),
        "generate_kwargs": {
            "speaker": "ethan",
            "thinker_max_new_tokens": args.reply_tokens + 1,
            "talker_max_new_tokens": args.frames + 1,
            "do_sample": False,
            "min_new_tokens": "= max_new_tokens (EOS suppressed)",
        },
        "runs": [],
        "skipped": [],
    }

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    from omnistage.models.processor import load_processor

    t0 = time.monotonic()
    model = build_model(args.model, args.device, dtype, experts, args.seed)
    result["load_s"] = time.monotonic() - t0
    print(
        f"[baseline] {args.model} on {args.device} ({dtype}, experts {experts or 'default'}) built in "
        f"{result['load_s']:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    gen = Generator(model, load_processor(args.model), args.device)
    for i in range(args.warmup):
        elapsed, _ = gen.run([workload.prompts[i]], workload.reply_tokens, workload.frames)
        print(f"[baseline] warm-up {i + 1}/{args.warmup}: {elapsed:.2f}s", file=sys.stderr, flush=True)
    offset = args.warmup
    for batch in args.batch:
        if args.time_budget is not None and time.monotonic() - t_start > args.time_budget:
            result["skipped"].append({"batch": batch, "why": f"time budget of {args.time_budget:.0f}s spent"})
            continue
        level = run_batch(gen, workload, batch, args.requests, offset)
        offset += len(level.records)
        entry = level.summary()
        entry["requests"] = [r.to_json() for r in level.records]
        result["runs"].append(entry)
        if args.device.startswith("cuda"):
            result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        save()
        print(
            f"[baseline] batch {batch}: {entry['throughput_rps']:.3f} req/s, TTFP {entry['ttfp_ms']['mean']:.0f} ms, "
            f"RTF {entry['rtf']['mean']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
