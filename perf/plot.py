# PNG of a concurrency sweep: throughput, mean TTFP and mean RTF against concurrency, one line per
# series, baselines as horizontal markers. matplotlib is optional: without it nothing is drawn and the
# caller records why.
from __future__ import annotations

from pathlib import Path


def _mean(stat):
    return None if not stat else stat["mean"]


def plot_sweep(
    series: dict[str, list[dict]], out: Path, baselines: dict[str, dict] | None = None, title: str = ""
) -> dict:
    """series: label -> level summaries (perf.metrics.LevelResult.summary()); baselines: label -> a
    summary-like dict with throughput_rps / ttfp_ms / rtf at a `concurrency` (batch size).
    Returns {"path": str} or {"skipped": reason}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:
        return {"skipped": f"matplotlib not importable ({exc}); no plot"}
    panels = (
        ("throughput_rps", "requests / s", lambda s: s.get("throughput_rps")),
        ("ttfp_ms", "mean TTFP (ms)", lambda s: _mean(s.get("ttfp_ms"))),
        ("rtf", "mean RTF", lambda s: _mean(s.get("rtf"))),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (_, ylabel, get) in zip(axes, panels):
        for label, levels in series.items():
            pts = [(s["concurrency"], get(s)) for s in levels if get(s) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        for j, (label, b) in enumerate((baselines or {}).items()):
            if get(b) is not None:
                ax.scatter(
                    [b["concurrency"]],
                    [get(b)],
                    marker=["x", "s", "^", "v"][j % 4],
                    s=70,
                    label=label,
                    zorder=3,
                    color=f"C{len(series) + j}",
                )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("concurrency (baseline: batch size)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"path": str(out)}
