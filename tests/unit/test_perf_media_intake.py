# perf/media_intake_timing.py: the host's cost of a media prompt before any model computes on it, per
# workload: omni_ensemble's preprocessing and the thinker's admission, with the patches each carries.
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_media_workload_gets_its_preprocessing_and_admission_timed(tmp_path):
    out = tmp_path / "intake.json"
    args = ["--prompts", "1", "--repeat", "1", "--burst", "2"]
    subprocess.run([sys.executable, "-m", "perf.media_intake_timing", str(out), *args], cwd=REPO, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    levels = json.loads(out.read_text())["levels"]
    assert set(levels) == {"w3", "w4", "w5"}
    assert all(level["preprocess_ms"] > 0 and level["thinker_admission_ms"] > 0 for level in levels.values())
    assert all(len(level["burst_of_2_mean_wait_ms"]) == 2 and min(level["burst_of_2_mean_wait_ms"].values()) > 0
               for level in levels.values())  # fmt: skip
    # a voice clip carries no patches; a 10 s video many times a picture's
    assert levels["w3"]["patches_mb"] == 0 and levels["w5"]["patches_mb"] > 4 * levels["w4"]["patches_mb"] > 0
