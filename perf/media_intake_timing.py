# What a media prompt costs on the host before any model computes on it, for W3, W4 and W5 prompts: in
# omni_ensemble, the preprocessing (decoded media, features, patches, token ids: prepare_inputs); in the
# thinker, the admission on the one thread that takes its requests in (ThinkerRunner.validate: the media
# digests of the prefix cache and the MRoPE positions), which a burst of media prompts waits for in turn.
# Median ms per prompt, on the tiny checkpoint (the released preprocessing settings: the same patches and
# features as the full-size model gets). Writes JSON to argv[1].
#
#   python -m perf.media_intake_timing /tmp/intake.json [--prompts 8] [--repeat 3]
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

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


def patch_bytes(inputs: dict) -> int:
    return sum(inputs[k].numel() * inputs[k].element_size() for k in ("pixel_values", "pixel_values_videos") if k in inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from transformers import Qwen3OmniMoeForConditionalGeneration

    checkpoint = make_tiny_checkpoint(tempfile.mkdtemp(prefix="intake-"), seed=0)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = load_processor(checkpoint)
    unit = block_bytes(model.config.thinker_config.text_config, torch.float32)
    runner = ThinkerRunner(model.thinker, model.config, max_slots=4, max_seq_len=4096, device="cpu",
                           dtype=torch.float32, prefix_cache_bytes=512 * unit)  # fmt: skip
    report = {"host": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "levels": {}}
    for name in WORKLOADS:
        workload = workloads.build(name, a.prompts)
        options = workload.options  # use_audio_in_video for W5
        prompts = workload.prompts
        prepare_inputs(processor, prompts[0], **options)  # first-call costs (imports, caches) left out
        inputs = [thinker_inputs(prepare_inputs(processor, m, **options)) for m in prompts]
        params = {"max_tokens": 2, "export_talker": True, **options}

        def admit(x):
            runner.validate(thinker_sequence("timing", x, params, thinker_defaults(4096)))

        report["levels"][name] = {
            "preprocess_ms": median_ms(lambda m: thinker_inputs(prepare_inputs(processor, m, **options)), prompts, a.repeat),
            "thinker_admission_ms": median_ms(admit, inputs, a.repeat),
            "patches_mb": round(statistics.mean(patch_bytes(x) for x in inputs) / 2**20, 1),
        }
        print(name, report["levels"][name], flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
