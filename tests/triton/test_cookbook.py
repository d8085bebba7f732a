# docs/clients.md, run as written: every ```python and ```sh block of the cookbook against a real
# tritonserver (tiny checkpoint) and the OpenAI frontend, each in its own directory, with OMNISTAGE_URL and
# TRITON_GRPC pointing at them. Triton is locked with a key as `serve` locks it, and the examples get it in
# OMNISTAGE_TRITON_KEY as a user would pass it. The stages' default lengths are short here, so the examples
# need no length settings of their own (random weights never stop by themselves). The other Triton clients
# the docs give, tools/omni_grpc_client.py (docs/architecture.md) and perf_analyzer's sweep
# (perf/perf_analyzer/README.md), run against the same server, with the key and without it.
import json
import os
import re
import subprocess
import sys
import wave

import pytest

from omnistage.core.protocol import TRITON_KEY_ENV
from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from ..api.servers import FrontendProcess
from .conftest import RepoSpec

COOKBOOK = REPO_ROOT / "docs" / "clients.md"
KEY = "cookbook-key-" + os.urandom(8).hex()
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.DOTALL | re.MULTILINE)
# what each block leaves behind: the files it writes, and a text its output must hold
EXPECT = {
    "Chat with audio": (["reply.wav"], "transcript:"),
    "Streamed playback to a file": (["story.wav"], ""),
    "Speech": (["speech.wav"], ""),
    "Tools": ([], ""),
    "curl": ([], '"object":"chat.completion"'),
    "tritonclient: gRPC streaming against omni_ensemble": (["grpc.wav"], ""),
}


def blocks() -> list[tuple[str, str, str]]:
    """(heading, language, code) of every example, under the nearest heading above it."""
    text = COOKBOOK.read_text()
    out = []
    for m in BLOCK.finditer(text):
        heading = re.findall(r"^#+ (.+)$", text[: m.start()], re.MULTILINE)[-1]
        out.append((heading, m.group(1), m.group(2)))
    return out


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    spec = default_spec(str(tiny_checkpoint), "cpu")
    spec["thinker"].parameters["sampling_defaults"] = json.dumps({"max_tokens": 12})
    spec["talker"].parameters["sampling_defaults"] = json.dumps({"max_tokens": 40})
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository", api_key=KEY)


@pytest.fixture(scope="module")
def frontend(triton_server):
    with FrontendProcess("--triton-url", triton_server.grpc_url, env={TRITON_KEY_ENV: KEY}) as f:
        yield f
    print(f.output)


def test_every_example_is_checked():
    assert sorted({h for h, _, _ in blocks()}) == sorted(EXPECT)


@pytest.mark.parametrize("heading, language, code", blocks(), ids=[b[0] for b in blocks()])
def test_example_runs(frontend, triton_server, tmp_path, heading, language, code):
    env = {**os.environ, "OMNISTAGE_URL": frontend.url, "TRITON_GRPC": triton_server.grpc_url,
           TRITON_KEY_ENV: KEY}
    cmd = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files, needle = EXPECT[heading]
    assert needle in done.stdout, done.stdout[-2000:]
    for name in files:
        with wave.open(str(tmp_path / name)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert w.getnframes() > 1920  # at least a codec frame of speech


def test_omni_grpc_client_sends_the_key_and_says_when_it_is_missing(triton_server, tmp_path):
    tool = [sys.executable, str(REPO_ROOT / "tools" / "omni_grpc_client.py"), "--url", triton_server.grpc_url,
            "--max-tokens", "4", "--talker-max-tokens", "8", "--param", "ignore_eos=true",
            "--param", "talker_ignore_eos=true", "--out", str(tmp_path / "reply.wav")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TRITON_KEY_ENV}
    done = subprocess.run(tool, env={**env, TRITON_KEY_ENV: KEY}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finish_reason: length" in done.stdout, done.stdout[-2000:]
    with wave.open(str(tmp_path / "reply.wav")) as w:
        assert w.getnframes() == 8 * 1920 - 555
    # without it: the refusal and what to do, instead of tritonclient's bare "stream is not in a valid state" traceback
    done = subprocess.run(tool, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert TRITON_KEY_ENV in done.stderr and "restricted" in done.stderr, done.stderr[-3000:]


def test_perf_analyzer_sweep_sends_the_key_and_stops_at_once_without_it(triton_server, tmp_path):
    from perf.perf_analyzer import sweep

    try:
        sweep.perf_analyzer()
    except SystemExit as e:  # libb64 missing: `make perf-analyzer` installs it
        pytest.skip(str(e))
    cmd = [sys.executable, "-m", "perf.perf_analyzer.sweep", "--url", triton_server.grpc_url, "--out", str(tmp_path),
           "--models", "omni_ensemble", "talker", "code2wav", "--concurrency", "1", "--requests-per-level", "1",
           "--reply-tokens", "2", "--frames", "4"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TRITON_KEY_ENV}
    done = subprocess.run(cmd, cwd=REPO_ROOT, env={**env, TRITON_KEY_ENV: KEY}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert KEY not in done.stdout  # the command line it prints hides the key
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["model"] for r in rows] == ["omni_ensemble", "talker", "code2wav"], rows
    assert all(r["answered"] == r["requests"] == 1 for r in rows), rows
    # refused, perf_analyzer 2.51 would wait forever: the sweep stops before it with what to do
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and TRITON_KEY_ENV in done.stderr, (done.stdout + done.stderr)[-3000:]
