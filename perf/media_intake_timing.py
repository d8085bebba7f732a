# What a media prompt costs on the host before any model computes on it, for W3, W4 and W5 prompts: in
# omni_ensemble, the preprocessing (decoded media, features, patches, token ids: prepare_inputs); in the
# thinker, the admission on the one thread that takes its requests in (ThinkerRunner.validate: the media
# digests of the prefix cache and the MRoPE positions). Median ms per prompt, on the tiny checkpoint (the
# released preprocessing settings: the same patches and features as the full-size model gets). And a burst
# of prompts arriving together: their mean wait until admitted, in turn on one thread against on the
# engine's intake threads (StageEngine.add_async). Writes JSON to argv[1].
#
#   python -m perf.media_intake_timing /tmp/intake.json [--prompts 8] [--repeat 3] [--burst 16]
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from omnistage.core.engine import INTAKE_THREADS
from omnistage.models.processor import load_processor, prepare_inputs
from omnistage.models.tiny_checkpoint import make_tiny_checkpoint
from omnistage.pipeline.request import thinker_inputs
from omnistage.stages.paged_kv import block_bytes
from omnistage.stages.thinker import ThinkerRunner
from omnistage.stages.wire import thinker_defaults, thinker_sequence
from perf import workloads

WORKLOADS = ("w3", "w4", "w5")


def median_ms(fn, items, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        for item in items:
            t0 = time.perf_counter()
            fn(item)
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


def burst_mean_wait_ms(admit, items, threads: int, repeat: int) -> float:
    """Mean ms from a burst's start until each of its items is admitted, by `threads` at once (0: in turn);
    the best of `repeat` bursts."""
    def one_burst() -> float:
        t0 = time.perf_counter()
        if not threads:
            waits = []
            for item in items:
                admit(item)
                waits.append(time.perf_counter() - t0)
            return statistics.mean(waits)
        with ThreadPoolExecutor(threads) as pool:
            return statistics.mean(pool.map(lambda item: (admit(item), time.perf_counter() - t0)[1], items))

    return round(min(one_burst() for _ in range(repeat)) * 1e3, 1)


def patch_bytes(inputs: dict) -> int:
    return sum(inputs[k].numel() * inputs[k].element_size() for k in ("pixel_values", "pixel_values_videos") if k in inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16, help="prompts arriving together")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as the GPU stages run (stage_model.init_instance)
    from transformers import Qwen3OmniMoeForConditionalGeneration

    checkpoint = make_tiny_checkpoint(tempfile.mkdtemp(prefix="intake-"), seed=0)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = load_processor(checkpoint)
    unit = block_bytes(model.config.thinker_config.text_config, torch.float32)
    runner = ThinkerRunner(model.thinker, model.config, max_slots=4, max_seq_len=4096, device="cpu",
                           dtype=torch.float32, prefix_cache_bytes=512 * unit)  # fmt: skip
    report = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "levels": {}}
    for name in WORKLOADS:
        workload = workloads.build(name, a.prompts)
        options = workload.options  # use_audio_in_video for W5
        prompts = workload.prompts

        def preprocess(messages):
            return thinker_inputs(prepare_inputs(processor, messages, **options))

        preprocess(prompts[0])  # first-call costs (imports, caches) left out
        inputs = [preprocess(m) for m in prompts]
        params = {"max_tokens": 2, "export_talker": True, **options}

        def admit(x):
            runner.validate(thinker_sequence("timing", x, params, thinker_defaults(4096)))

        report["levels"][name] = {
            "preprocess_ms": median_ms(preprocess, prompts, a.repeat),
            "thinker_admission_ms": median_ms(admit, inputs, a.repeat),
            "patches_mb": round(statistics.mean(patch_bytes(x) for x in inputs) / 2**20, 1),
        }
        burst = [inputs[i % len(inputs)] for i in range(a.burst)]
        report["levels"][name][f"burst_of_{a.burst}_mean_wait_ms"] = {
            "in_turn": burst_mean_wait_ms(admit, burst, 0, a.repeat),
            f"intake_threads_{INTAKE_THREADS}": burst_mean_wait_ms(admit, burst, INTAKE_THREADS, a.repeat)}
        print(name, report["levels"][name], flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
