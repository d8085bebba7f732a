# Triton 2.51's stub frees finished BLS response iterators in a native thread, off the GIL, unless the
# model holds them until a later is_cancelled() round trip (omnistage/triton/iterator_reaper.py). The
# stand-in orchestrator of tools/bls_stress holds them as omni_ensemble does and puts a finalizer on every
# numpy array it receives: a finalizer run off the GIL kills the stub at once, and without the reaper that
# happens within the first round (`python tools/bls_stress/run.py --free-probe`).
import re
import subprocess
import sys

from omnistage.launch.triton_env import REPO_ROOT


def test_bls_responses_are_freed_on_python_threads(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bls_stress" / "run.py"), "--concurrency", "16", "--rounds", "8",
         "--free-probe", "--reaper", "--run-dir", str(tmp_path / "bls_stress")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "no fatal stub errors in the log" in out
    freed, watched = map(int, re.findall(r"free probe: (\d+) of (\d+) arrays freed", out)[-1])
    # 16 x 8 requests of 6 responses with 2 host tensors each (the count is printed as it goes, so the last
    # few may be missing); all are freed but those held at the end, up to one round's worth
    assert 16 * 7 * 6 * 2 <= watched <= 16 * 8 * 6 * 2
    assert freed >= watched - 16 * 6 * 2, out[-2000:]
