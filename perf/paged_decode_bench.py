# The paged decode attention (models/paged_attention.py decode()) of one step, as served: the step's layers'
# calls captured in one CUDA graph and replayed, the thinker's (48 layers, 32 query and 4 KV heads) and the
# talker's (20 layers, 16 and 2) geometry, bf16, head dim 128. Rows: 64 W1-like streams (150-213 positions),
# 32 W2-like ones (2,500-3,400) and 64 W1-like ones beside 4 of 30,000. Each case for every --min-part
# (paged_attention.MIN_PART, the fewest positions a part walks), in turn, --rounds times; ms per step.
# `TRITON_INTERPRET=1 ... --device cpu` checks the script on the CPU (eager, short stand-ins).
#
#   python -m perf.paged_decode_bench $OUT/paged_decode.json [--min-part 64 256] [--rounds 2]
from __future__ import annotations

import argparse
import json

import torch

from omnistage.models import paged_attention
from omnistage.stages.paged_kv import PagedKVCache
from perf.media_prefill_timing import timed

GEOMETRY = {"thinker": (32, 4, 48), "talker": (16, 2, 20)}  # query heads, KV heads, layers
CASES = {
    "w1_64": [150 + i for i in range(64)],
    "w2_32": [2500 + 29 * i for i in range(32)],
    "w1_64_beside_4x30k": [150 + i for i in range(64)] + [30000] * 4,
}


def case(heads: int, kv_heads: int, layers: int, lengths: list[int], device, min_parts: list[int],
         rounds: int) -> dict:  # fmt: skip
    dim, dtype = 128, torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = PagedKVCache(1, len(lengths), kv_heads, dim, num_blocks=sum(-(-n // 16) for n in lengths) + 16,
                         max_len=max(lengths), dtype=dtype, device=device)  # fmt: skip
    for slot, n in enumerate(lengths):
        cache.grow(slot, n)
    cache.sync()
    g = torch.Generator(device=device).manual_seed(0)
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g, device=device))
    query = torch.randn(len(lengths), heads, 1, dim, generator=g, device=device).to(dtype)
    lengths_t = torch.tensor(lengths, device=device)

    def step():
        return [paged_attention.decode(query, cache.k[0], cache.v[0], cache.table, lengths_t, dim**-0.5)
                for _ in range(layers if device.type == "cuda" else 1)]  # fmt: skip

    out, first = {}, None
    for r in range(rounds):
        for min_part in min_parts:
            paged_attention.MIN_PART = min_part
            if device.type == "cuda":
                step()  # compiles this MIN_PART's kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = step()
                run = graph.replay
            else:
                run = step
                got = step()
            out[f"ms_min_part_{min_part}_round{r}"] = timed(run, device, repeat=20 if device.type == "cuda" else 1)
            run()
            if first is None:
                first = got[0].float().clone()
            out["max_abs_diff"] = max(out.get("max_abs_diff", 0.0), float((got[0].float() - first).abs().max()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--min-part", type=int, nargs="+", default=[paged_attention.TILE, paged_attention.MIN_PART])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "what": "one decode step's paged attention (all its layers' calls in one CUDA graph), ms per step",
              "cases": {}}  # fmt: skip
    for stage, (heads, kv_heads, layers) in GEOMETRY.items():
        for name, lengths in CASES.items():
            if device.type == "cpu":  # the interpreter: a short stand-in of each shape
                lengths = [n // 64 + 1 for n in lengths][:3] + [300]
            result = case(heads, kv_heads, layers, lengths, device, args.min_part, args.rounds)
            report["cases"][f"{stage}/{name}"] = result
            print(stage, name, result, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
