# One layer's paged prefill attention (models/paged_attention.py) for long prompts' pieces, the thinker's
# and the talker's head geometry, bf16: a lone 512- or 128-token piece at 30,000 positions (a long prompt
# beside decodes), and 16 rows of a step of W2 prompts (2,500 tokens in 512-token rows), each with its
# positions split into parts as prefill_parts() chooses against one program per tile walking them all
# (parts=1); with --sweep, the thinker's cases under other launch settings (tile, warps, stages). Writes JSON to
# argv[1]; `TRITON_INTERPRET=1 ... --device cpu --repeat 1` checks the script on the CPU.
#
#   python -m perf.paged_prefill_bench $OUT/paged_prefill.json
from __future__ import annotations

import argparse
import json

import torch

from omnistage.models import paged_attention
from omnistage.stages.paged_kv import PagedKVCache
from perf.media_prefill_timing import timed

GEOMETRY = {"thinker": (32, 4), "talker": (16, 2)}  # query heads, KV heads; head dim 128
CASES = {  # name: (rows' starts, tokens per row)
    "piece512_at_30k": ([29488], 512),
    "piece128_at_30k": ([29872], 128),
    "w2_rows": ([512 * (i % 5) for i in range(16)], 512),
}


def case(heads: int, kv_heads: int, starts: list[int], tokens: int, device, dtype, repeat: int,
         sweep: bool = False) -> dict:
    dim, max_len = 128, max(starts) + tokens
    cache = PagedKVCache(1, len(starts), kv_heads, dim, num_blocks=-(-sum(s + tokens for s in starts) // 16) + 64,
                         max_len=max_len, dtype=dtype, device=device)  # fmt: skip
    for slot, start in enumerate(starts):
        cache.grow(slot, start + tokens)
    cache.sync()
    g = torch.Generator(device=device).manual_seed(0)
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g, device=device))
    query = torch.randn(len(starts), heads, tokens, dim, generator=g, device=device).to(dtype)
    slots, starts_t = torch.arange(len(starts), device=device), torch.tensor(starts, device=device)
    tiles = -(-tokens // paged_attention.PREFILL_QUERIES)
    chosen = paged_attention.prefill_parts(len(starts) * kv_heads * tiles, device)
    run = lambda parts, launch=None: paged_attention.prefill(query, cache.k[0], cache.v[0], cache.table, slots,  # noqa: E731
                                                             starts_t, dim**-0.5, parts=parts, launch=launch)  # fmt: skip
    out = {"parts": chosen, "ms_parts_1": timed(lambda: run(1), device, repeat)}
    out["ms_chosen"] = timed(lambda: run(chosen), device, repeat)
    pairs = sum(tokens * s + tokens * (tokens + 1) // 2 for s in starts) * heads  # causal (query, key) pairs
    out["tflops_chosen"] = round(4 * pairs * dim / (out["ms_chosen"] * 1e-3) / 1e12, 1)
    out["max_abs_diff"] = float((run(1).float() - run(chosen).float()).abs().max())
    if sweep:  # the same call with other launch settings: its time and how far its output is from the default's
        want = run(chosen).float()
        out["sweep"] = [dict(launch, ms=timed(lambda launch=launch: run(chosen, launch), device, repeat),
                             max_abs_diff=float((run(chosen, launch).float() - want).abs().max()))
                        for launch in SWEEP]  # fmt: skip
    return out


# launch settings --sweep tries (models/paged_attention.py PREFILL_LAUNCH)
SWEEP = [{"tile": t, "num_warps": w, "num_stages": st} for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also each of SWEEP's launch settings, thinker only")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "what": "one layer's paged prefill attention, head dim 128", "cases": {}}  # fmt: skip
    for stage, (heads, kv_heads) in GEOMETRY.items():
        for name, (starts, tokens) in CASES.items():
            if device.type == "cpu":  # the interpreter: a short stand-in of each shape
                starts, tokens = [s // 64 for s in starts][:2], min(tokens, 32)
            report["cases"][f"{stage}/{name}"] = case(heads, kv_heads, starts, tokens, device, dtype, args.repeat,
                                                      sweep=args.sweep and stage == "thinker")  # fmt: skip
            print(stage, name, report["cases"][f"{stage}/{name}"], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
