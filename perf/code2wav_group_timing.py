# One main-lane Code2Wav step (stages/code2wav_stage.py Code2WavLane) over a group of later chunks, in
# process on the full-size config with dummy weights, the fused kernels and the later decoder's CUDA graphs:
# the way the lane picks (graph slices while they are at most EAGER_FORWARD_SLICES per shape, else eager by
# shape) against graph slices alone and eager by shape alone. Groups: N realtime sessions whose ramped chunks (chunking.py's playback
# schedule) left them at different positions, and N text-to-speech streams that started together (25-frame
# chunks at one position). Writes JSON to argv[1]; ms per group, mean of --repeat after a warm-up.
#
#   python -m perf.code2wav_group_timing $OUT/c2w_groups.json [--streams 8 16 32]
#   python -m perf.code2wav_group_timing /tmp/c2w.json --device cpu --model dummy:tiny --streams 6 --repeat 1
from __future__ import annotations

import argparse
import json

import torch

from omnistage.core.chunking import ChunkSchedule
from omnistage.models import fused
from omnistage.models.checkpoint import load_stage
from omnistage.stages.code2wav import Code2WavRunner, chunk_key
from omnistage.stages.code2wav_later import LaterChunkDecoder
from omnistage.stages.code2wav_stage import LATER_CHUNK_BATCH, Code2WavLane, Code2WavSessions
from omnistage.stages.step_stream import StepStream
from perf.media_prefill_timing import timed


def realtime_group(runner, streams: int, codes) -> list:
    """Stream i decoded through the first i % 6 + 1 chunks of the playback schedule; its next chunk."""
    schedule, chunks = ChunkSchedule(first_chunk_frames=1).for_playback(), []
    for i in range(streams):
        state, emitted = None, 0
        for _ in range(i % 6 + 1):
            n = schedule.next_frames(emitted)
            [(_, state)] = runner.decode([(codes(n), state)])
            emitted += n
        chunks.append((codes(schedule.next_frames(emitted)), state))
    return chunks


def tts_group(runner, streams: int, codes) -> list:
    """Streams that started together: a 1-frame first chunk, then a 25-frame chunk each at one position."""
    [(_, state)] = runner.decode([(codes(1), None)])
    return [(codes(25), state) for _ in range(streams)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="dummy:perf/qwen3_omni_30b_a3b_instruct.config.json")
    ap.add_argument("--device", default="cuda", help="cpu (with --model dummy:tiny) checks the script")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    module = load_stage(args.model, "code2wav", dtype, dev)
    if cuda:
        fused.install(module)
    runner = Code2WavRunner(module, dev, dtype)
    later = LaterChunkDecoder(runner, 25, LATER_CHUNK_BATCH, cuda_graphs=cuda)
    later.capture_all()
    lane = Code2WavLane(runner, Code2WavSessions(), 64, StepStream(dev, enabled=False), cuda, later=later)
    g = torch.Generator(device=dev).manual_seed(0)

    def codes(n: int) -> torch.Tensor:
        return torch.randint(0, runner.codebook_size, (n, runner.num_quantizers), device=dev, generator=g)

    report = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "weights": args.model,
              "model": "full-size Qwen3-Omni-30B-A3B config", "later_chunk_batch": LATER_CHUNK_BATCH, "groups": {}}  # fmt: skip
    for name, make in (("realtime", realtime_group), ("tts", tts_group)):
        for streams in args.streams:
            chunks = make(runner, streams, codes)
            ways = {"lane": lambda chunks=chunks: lane._decode(chunks),
                    "slices": lambda chunks=chunks: later.decode(chunks),
                    "eager": lambda chunks=chunks: list(runner.decode_groups(chunks, check_ranges=False))}  # fmt: skip
            row = {"shapes": len({chunk_key(*c) for c in chunks}), "frames": sum(int(c[0].shape[0]) for c in chunks)}
            for r in range(2):  # in turn, twice
                for way, fn in ways.items():
                    row[f"{way}_ms_{r}"] = timed(fn, dev, args.repeat)
            report["groups"][f"{name}_{streams}"] = row
            print(name, streams, row, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
