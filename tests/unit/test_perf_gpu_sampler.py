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


def test_process_state_tells_running_exited_and_gone_processes_apart():
    import subprocess

    from omnistage.launch.proc_stats import process_state

    assert process_state(os.getpid())["state"] in ("R", "S")
    child = subprocess.Popen(["sleep", "0"])
    deadline = time.monotonic() + 5
    while process_state(child.pid)["state"] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(child.pid)["state"] == "Z"  # exited, not yet reaped
    child.wait()
    assert process_state(child.pid) == {"state": "gone"}


def test_stall_evidence_names_each_stub_state_and_keeps_the_gpu_and_kernel_view(tmp_path):
    from perf.gpu_bench import Bench

    bench = Bench.__new__(Bench)  # only what stall_evidence reads
    bench.stacks_dir, bench.server = tmp_path / "stacks", None
    bench.stubs = {"talker": [os.getpid()], "code2wav": [2**22 + 1]}
    states = bench.stall_evidence()
    assert states["talker"][0]["state"] in ("R", "S") and states["talker"][0]["pid"] == str(os.getpid())
    assert int(states["talker"][0]["threads"]) >= 1
    assert states["code2wav"] == [{"state": "gone", "pid": str(2**22 + 1)}]
    assert {p.name for p in (tmp_path / "stacks").iterdir()} == {"nvidia-smi.txt", "dmesg.txt"}
