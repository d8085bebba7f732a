# perf/frontend_timing.py end to end: the real frontend over the fake Triton, a short closed loop per workload.
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_workload_gets_the_frontends_own_times(tmp_path):
    out = tmp_path / "frontend.json"
    subprocess.run([sys.executable, "-m", "perf.frontend_timing", str(out), "--workloads", "w1,w3", "--concurrency", "2"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)  # fmt: skip
    (level,) = json.loads(out.read_text())["rounds"]
    assert set(level) == {"w1", "w3"}
    for times in level.values():
        assert times["requests"] > 0 and times["frontend_cpu_s"] > 0
        # hand-over to Triton comes before the first token, which comes after the fake's 50 ms
        assert 0 < times["arrival_to_handled_ms"]["mean"] < times["arrival_to_first_token_ms"]
        assert times["arrival_to_first_token_ms"] >= 50 and times["client_ttft_ms"] >= 50
