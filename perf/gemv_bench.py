# One- and two-row matmuls of a lone request's decode steps, cuBLAS (F.linear; the picked experts' weights
# gathered, then bmm) against omnistage/models/gemv.py, each as 50 calls replayed in a CUDA graph (as the
# served decode steps run them): microseconds per call and the weight bandwidth it reached. Full-size
# Qwen3-Omni shapes, random bf16 values; writes JSON to argv[1]. Then the kernel's tuning (programs per call,
# warps per program) over a lone talker frame's and thinker step's mix of these calls.
#
#   python -m perf.gemv_bench out.json
from __future__ import annotations

import json
import sys

import torch
from transformers.integrations.moe import _batched_linear

from omnistage.models import gemv

CALLS, REPLAYS = 50, 20
# (name, rows, K, N): code predictor (hidden 1024, 16 q / 8 kv heads of 128, MLP 3072), talker text
# (1024, 16 / 2 heads, shared expert 768), thinker text (2048, 32 / 4 heads)
DENSE = [("code_predictor_qkv", 1, 1024, 4096), ("code_predictor_o", 1, 2048, 1024),
         ("code_predictor_gate_up", 1, 1024, 6144), ("code_predictor_down", 1, 3072, 1024),
         ("talker_qkv", 1, 1024, 2560), ("talker_o", 1, 2048, 1024), ("talker_shared_gate_up", 1, 1024, 1536),
         ("thinker_qkv", 1, 2048, 5120), ("thinker_o", 1, 4096, 2048), ("code_predictor_gate_up_2rows", 2, 1024, 6144)]  # fmt: skip
# (name, tokens, top_k, experts, K, N_gate_up): the picked experts' gate/up projection
EXPERTS = [("talker_experts_gate_up", 1, 6, 128, 1024, 768), ("thinker_experts_gate_up", 1, 8, 128, 2048, 1536),
           ("thinker_experts_down", 1, 8, 128, 768, 2048)]  # fmt: skip


def graphed_us(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def cases(dev, dtype) -> dict:
    """name -> (cuBLAS's call, gemv's call taking the tuning keywords, weight bytes it reads), on random inputs."""
    out = {}
    for name, rows, k, n in DENSE:
        x, w = torch.randn(rows, k, device=dev, dtype=dtype), torch.randn(n, k, device=dev, dtype=dtype)
        out[name] = (lambda x=x, w=w: torch.nn.functional.linear(x, w),
                     lambda x=x, w=w, **kw: gemv.gemv(x, w, **kw), w.numel() * 2)  # fmt: skip
    for name, tokens, top_k, experts, k, n in EXPERTS:
        x, w = torch.randn(tokens, k, device=dev, dtype=dtype), torch.randn(experts, n, k, device=dev, dtype=dtype)
        ids = torch.randperm(experts, device=dev)[: tokens * top_k]
        # cuBLAS's way: the picked experts' weights gathered, then one bmm (experts.py's gathered path)
        out[name] = (lambda x=x, w=w, ids=ids, top_k=top_k: _batched_linear(x.repeat_interleave(top_k, dim=0), w[ids]),
                     lambda x=x, w=w, ids=ids, top_k=top_k, **kw: gemv.gemv(x, w, ids, top_k, **kw),
                     tokens * top_k * n * k * 2)  # fmt: skip
    return out


def main() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "weights": "random bf16",
              "cases": {}}  # fmt: skip
    calls = cases(dev, dtype)
    for name, (cublas, ours, weight_bytes) in calls.items():
        report["cases"][name] = _entry(graphed_us(cublas), graphed_us(ours), weight_bytes)
    report["tuning"] = tune(calls)
    json.dump(report, open(sys.argv[1], "w"), indent=1)
    for name, case in report["cases"].items():
        print(f"{name:32s} cublas {case['cublas_us']:7.1f} us  gemv {case['gemv_us']:7.1f} us  "
              f"x{case['speedup']:.2f}  gemv {case['gemv_tb_s']:.2f} TB/s")  # fmt: skip


# calls per lone talker frame (LM step: 20 layers; code predictor: 15 sub-steps x 5 layers) and thinker step
FRAME_MIX = {"code_predictor_qkv": 75, "code_predictor_o": 75, "code_predictor_gate_up": 75, "code_predictor_down": 75,
             "talker_qkv": 20, "talker_o": 20, "talker_experts_gate_up": 20}  # fmt: skip
THINKER_MIX = {"thinker_qkv": 48, "thinker_o": 48, "thinker_experts_gate_up": 48, "thinker_experts_down": 48}


def tune(calls: dict) -> dict:
    """Microseconds of each mix per (programs, num_warps)."""
    out = {}
    for programs in (256, 512, 1024, 2048):
        for warps in (2, 4, 8):
            us = {name: graphed_us(lambda ours=ours: ours(programs=programs, num_warps=warps))
                  for name, (_, ours, _) in calls.items()}  # fmt: skip
            key = f"programs={programs} warps={warps}"
            out[key] = {"frame_us": round(sum(c * us[n] for n, c in FRAME_MIX.items()), 1),
                        "thinker_step_us": round(sum(c * us[n] for n, c in THINKER_MIX.items()), 1)}  # fmt: skip
            print(key, out[key], flush=True)
    return out


def _entry(cublas_us: float, gemv_us: float, weight_bytes: int) -> dict:
    return {"cublas_us": round(cublas_us, 2), "gemv_us": round(gemv_us, 2), "speedup": round(cublas_us / gemv_us, 2),
            "weight_mb": round(weight_bytes / 1e6, 2), "gemv_tb_s": round(weight_bytes / gemv_us / 1e6, 2)}  # fmt: skip


if __name__ == "__main__":
    main()
