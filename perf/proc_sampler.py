# RSS and thread count of every process of a served stack (tritonserver, each model instance's stub by its
# instance name, the frontend), sampled every few seconds on a thread of its own while a soak runs, and
# whether each levelled off: after the warm-up, RSS grows in the second half of the run by no more than the
# margin, and threads end within a slack of where the warm-up left them.
from __future__ import annotations

import threading
import time
from pathlib import Path

from omnistage.launch.proc_stats import children, cmdline

# the second half of the run may add this much to a process's RSS peak (whichever is larger): allocator
# noise, the last requests' buffers not yet freed when sampled
LEVEL_MARGIN_MB, LEVEL_MARGIN_FRACTION = 16.0, 0.05
THREAD_SLACK = 16  # threads of pools that grow and shrink with the load (core/daemon_pool.py) mid-request


def _status(pid: int) -> tuple[float, int] | None:
    """(RSS in MB, threads) of a live process."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return None
    if fields.get("State", "").strip().startswith("Z"):
        return None
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


def processes(triton_pid: int, frontend_pid: int | None) -> dict[str, int]:
    """name -> pid: "tritonserver", each stub by its model instance (argv[8], e.g. omni_ensemble_0_1; the
    newest where a reload left an older one), "frontend"."""
    out = {"tritonserver": triton_pid}
    for pid in sorted(children(triton_pid)):  # pids grow: a newer stub of an instance comes later
        argv = cmdline(pid)
        if len(argv) > 8 and argv[0].endswith("triton_python_backend_stub"):
            out[argv[8]] = pid
    if frontend_pid is not None:
        out["frontend"] = frontend_pid
    return out


def sample(triton_pid: int, frontend_pid: int | None) -> dict[str, dict]:
    out = {}
    for name, pid in processes(triton_pid, frontend_pid).items():
        status = _status(pid)
        if status is not None:
            out[name] = {"rss_mb": round(status[0], 1), "threads": status[1]}
    return out


class ProcSampler:
    """Samples every `every_s` seconds from start() to stop(); samples: [{"t": seconds since start, name:
    {"rss_mb", "threads"}}]. triton_pid is a callable: the launcher may restart tritonserver."""

    def __init__(self, triton_pid, frontend_pid: int | None, every_s: float = 15.0):
        self.triton_pid, self.frontend_pid, self.every_s = triton_pid, frontend_pid, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proc-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> ProcSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        self._take()  # the last one at the end
        return self.samples

    def _take(self) -> None:
        self.samples.append({"t": round(self.elapsed(), 1), **sample(self.triton_pid(), self.frontend_pid)})

    def _loop(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.every_s):
                return


def levelling(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per process, over the samples after warm-up: RSS at the warm-up's end, its peak in the first and in the
    second half of the rest and at the end, the thread count at the warm-up's end, its peak and at the end, and
    whether it levelled off (the second half's RSS peak at most the margin above the first half's; threads at
    the end within THREAD_SLACK of the warm-up's end)."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 5:
        return {}
    out = {}
    for name in after[-1]:
        series = [s[name] for s in after if name in s]
        if name == "t" or len(series) < 5:
            continue
        half = len(series) // 2
        rss = [p["rss_mb"] for p in series]
        peaks = max(rss[1 : half + 1]), max(rss[half + 1 :])
        margin = max(LEVEL_MARGIN_MB, LEVEL_MARGIN_FRACTION * peaks[0])
        threads = [p["threads"] for p in series]
        out[name] = {
            "rss_mb": {"warm": rss[0], "first_half_peak": peaks[0], "second_half_peak": peaks[1], "end": rss[-1]},
            "margin_mb": round(margin, 1),
            "threads": {"warm": threads[0], "peak": max(threads), "end": threads[-1]},
            "levels_off": peaks[1] - peaks[0] <= margin and threads[-1] <= threads[0] + THREAD_SLACK,
        }
    return out
