# perf/proc_sampler.py: what the soak reads of each process, and its verdict on whether RSS and threads
# levelled off after the warm-up.
import os
import subprocess
import sys

from perf.proc_sampler import LEVEL_MARGIN_MB, THREAD_SLACK, ProcSampler, levelling, sample


def series(rss, threads=None):
    threads = threads or [20] * len(rss)
    return [{"t": 15.0 * i, "omni_ensemble_0_0": {"rss_mb": r, "threads": n}}
            for i, (r, n) in enumerate(zip(rss, threads))]


def test_growth_that_stops_levels_off_and_growth_that_goes_on_does_not():
    warm_s = 30.0  # the first two samples are the warm-up's
    rising_then_flat = [100, 300, 500, 700, 760, 780, 790, 790, 795, 790, 792, 794, 790]
    still_rising = [100, 300, 500, 540, 580, 620, 660, 700, 740, 780, 820, 860, 900]
    flat = levelling(series(rising_then_flat), warm_s)["omni_ensemble_0_0"]
    assert flat["levels_off"] and flat["rss_mb"]["warm"] == 500 and flat["rss_mb"]["end"] == 790
    rising = levelling(series(still_rising), warm_s)["omni_ensemble_0_0"]
    peaks = rising["rss_mb"]["first_half_peak"], rising["rss_mb"]["second_half_peak"]
    assert not rising["levels_off"] and peaks[1] - peaks[0] > LEVEL_MARGIN_MB


def test_threads_must_come_back_within_the_slack():
    rss = [100.0] * 12
    kept = levelling(series(rss, [20] * 11 + [20 + THREAD_SLACK + 1]), 0.0)["omni_ensemble_0_0"]
    back = levelling(series(rss, [20, 60, 90, 80, 70, 90, 60, 80, 70, 90, 60, 22]), 0.0)["omni_ensemble_0_0"]
    assert not kept["levels_off"] and back["levels_off"] and back["threads"] == {"warm": 20, "peak": 90, "end": 22}


def test_samples_name_the_server_its_stubs_and_the_frontend():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        got = sample(os.getpid(), child.pid)  # this process stands for tritonserver: it has no stubs
        assert set(got) == {"tritonserver", "frontend"}
        assert got["tritonserver"]["rss_mb"] > 10 and got["tritonserver"]["threads"] >= 1
        sampler = ProcSampler(os.getpid, child.pid, every_s=0.05).start()
        samples = sampler.stop()
        assert len(samples) >= 2 and samples[-1]["t"] >= samples[0]["t"] and "frontend" in samples[-1]
    finally:
        child.kill()
        child.wait()
