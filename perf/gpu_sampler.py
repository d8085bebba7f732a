# GPU utilisation over a stretch of a benchmark, from `nvidia-smi -lms` running alongside: the share of
# sample periods in which a kernel ran, per GPU. It tells a device-bound level from one whose stages wait
# on the host. None where nvidia-smi is missing (CPU dry runs).
from __future__ import annotations

import shutil
import subprocess


class GpuSampler:
    def __init__(self, period_ms: int = 200):
        self.period_ms = period_ms
        self.proc: subprocess.Popen | None = None

    def start(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        return self

    def stop(self) -> dict | None:
        """Per GPU index: samples, mean and max utilisation (%), max memory used (MiB)."""
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return summarize(out)


def summarize(csv_lines: str) -> dict:
    per_gpu: dict[str, list[tuple[float, float]]] = {}
    for line in csv_lines.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            index, util, mem = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            continue  # a line cut by the terminate, or "[N/A]"
        per_gpu.setdefault(index, []).append((util, mem))
    return {
        index: {
            "samples": len(rows),
            "util_mean_pct": round(sum(u for u, _ in rows) / len(rows), 1),
            "util_max_pct": max(u for u, _ in rows),
            "memory_max_mib": max(m for _, m in rows),
        }
        for index, rows in per_gpu.items()
    }
