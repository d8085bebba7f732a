# The benchmark's GPU-utilisation summary and the per-process CPU seconds it records next to it.
import os
import time

from omnistage.launch.proc_stats import cpu_seconds
from perf.gpu_sampler import summarize


def test_summarize_groups_by_gpu_and_skips_broken_lines():
    lines = "0, 50, 1000\n1, 0, 10\n0, 100, 3000\n0, [N/A], 5\n0, 7"
    s = summarize(lines)
    assert s == {
        "0": {"samples": 2, "util_mean_pct": 75.0, "util_max_pct": 100.0, "memory_max_mib": 3000.0},
        "1": {"samples": 1, "util_mean_pct": 0.0, "util_max_pct": 0.0, "memory_max_mib": 10.0},
    }
    assert summarize("") == {}


def test_cpu_seconds_grows_with_work_and_is_zero_for_a_gone_process():
    before = cpu_seconds(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.2
    assert cpu_seconds(2**22 + 12345) == 0.0  # above the kernel's pid_max default
