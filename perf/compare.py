# Ours against the transformers baseline (same run, same weights) and vLLM-Omni's published numbers.
# Ratios are ours / baseline: > 1 is better for throughput, < 1 is better for TTFP and RTF.
from __future__ import annotations

from pathlib import Path

from perf.metrics import ratio
from perf.plot import plot_sweep

# /work/shared/reference/README.md: vLLM-Omni on 3 GPUs (Thinker GPU0; 2x Talker + 2x Code2Wav on GPUs 1-2),
# Seed-TTS en, real weights. Not the same hardware or weights as ours: context, not a like-for-like ratio.
VLLM_OMNI_SEED_TTS = {
    64: {"concurrency": 64, "throughput_rps": 11.7, "ttfp_ms": {"mean": 632.0}, "rtf": {"mean": 0.47}},
    32: {"concurrency": 32, "throughput_rps": 6.8, "ttfp_ms": None, "rtf": None},
}
VLLM_OMNI_BATCH_BASELINE = {"throughput_rps": 2.2, "ttfp_ms": {"mean": 5884.0}, "rtf": {"mean": 1.15}}


def _mean(stat: dict | None) -> float | None:
    return None if not stat else stat.get("mean")


def comparison(ours: list[dict], baseline_runs: list[dict]) -> list[dict]:
    """One row per (our concurrency level, baseline batch size) with the three headline ratios."""
    rows = []
    for o in ours:
        if not o.get("completed"):
            continue
        for b in baseline_runs:
            rows.append(
                {
                    "ours_concurrency": o["concurrency"],
                    "baseline_batch": b["concurrency"],
                    "ours_rps": o["throughput_rps"],
                    "baseline_rps": b["throughput_rps"],
                    "throughput_ratio": ratio(o["throughput_rps"], b["throughput_rps"]),
                    "ours_mean_ttfp_ms": _mean(o["ttfp_ms"]),
                    "baseline_mean_ttfp_ms": _mean(b["ttfp_ms"]),
                    "ttfp_ratio": ratio(_mean(o["ttfp_ms"]), _mean(b["ttfp_ms"])),
                    "ours_mean_rtf": _mean(o["rtf"]),
                    "baseline_mean_rtf": _mean(b["rtf"]),
                    "rtf_ratio": ratio(_mean(o["rtf"]), _mean(b["rtf"])),
                }
            )
    return rows


def plot_bench(report: dict, png: Path) -> dict:
    # W1 only: the baselines and vLLM-Omni's numbers are W1-like; W2 stays in bench.json
    w1 = (report.get("ours") or {}).get("w1") or {}
    levels = [s for s in w1.get("levels", []) if s.get("completed")]
    series = {"omnistage (Triton, 1 GPU)": levels} if levels else {}
    baselines = {
        f"transformers generate() batch {r['concurrency']}": r
        for r in ((report.get("baseline") or {}).get("runs") or [])
    }
    baselines["vLLM-Omni published c=64 (3 GPUs, real weights)"] = VLLM_OMNI_SEED_TTS[64]
    if not series and len(baselines) == 1:
        return {"skipped": "no results to plot"}
    gpus = (report.get("hardware") or {}).get("gpus")
    gpu = gpus[0]["name"] if isinstance(gpus, list) and gpus else "?"
    model = (report.get("model") or {}).get("config", "?")
    return plot_sweep(
        series, png, baselines, title=f"W1 Seed-TTS-like; {model}; {report.get('weights', '?')}; 1x {gpu}"
    )


def reference() -> dict:
    return {
        "vllm_omni_seed_tts_3gpu": {str(k): v for k, v in VLLM_OMNI_SEED_TTS.items()},
        "vllm_omni_batch_baseline": VLLM_OMNI_BATCH_BASELINE,
        "transformers_measured_here_h200_2026_12_02": "batch 1: 6.6-7.7 s per request (RTF 1.8-2.1); "
        "batch 32: 14.3 s for 32 requests = 2.24 req/s (RTF 3.9); default experts, dummy bf16 weights",
        "source": "/work/shared/reference/README.md",
    }


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summary_text(report: dict) -> str:
    """The headline numbers as plain text, for the console."""
    lines = []
    for name, result in (report.get("ours") or {}).items():
        lines.append(f"ours {name}: conc  done/prompts  req/s  mean TTFP ms  mean RTF")
        for s in result.get("levels", []):
            if "skipped" in s:
                lines.append(f"  {s['concurrency']:>4}  skipped: {s['skipped']}")
                continue
            lines.append(
                f"  {s['concurrency']:>4}  {s['completed']:>4}/{s['num_prompts']:<7} {_f(s['throughput_rps']):>6}  "
                f"{_f(_mean(s['ttfp_ms']), 0):>12}  {_f(_mean(s['rtf'])):>8}"
            )
    for r in (report.get("baseline") or {}).get("runs") or []:
        lines.append(
            f"baseline batch {r['concurrency']}: {_f(r['throughput_rps'])} req/s, mean TTFP "
            f"{_f(_mean(r['ttfp_ms']), 0)} ms, mean RTF {_f(_mean(r['rtf']))}"
        )
    for c in report.get("comparison") or []:
        lines.append(
            f"ours c={c['ours_concurrency']} / baseline batch {c['baseline_batch']}: throughput x"
            f"{_f(c['throughput_ratio'], 2)}, TTFP x{_f(c['ttfp_ratio'], 2)}, RTF x{_f(c['rtf_ratio'], 2)}"
        )
    return "\n".join(lines)
