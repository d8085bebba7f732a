# docs/clients.md, run as written: every ```python and ```sh block of the cookbook against a real
# tritonserver (tiny checkpoint) and the OpenAI frontend, each in its own directory, with OMNISTAGE_URL and
# TRITON_GRPC pointing at them. The stages' default lengths are short here, so the examples need no
# length settings of their own (random weights never stop by themselves).
import json
import os
import re
import subprocess
import sys
import wave

import pytest

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from ..api.servers import FrontendProcess
from .conftest import RepoSpec

COOKBOOK = REPO_ROOT / "docs" / "clients.md"
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
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository")


@pytest.fixture(scope="module")
def frontend(triton_server):
    with FrontendProcess("--triton-url", triton_server.grpc_url) as f:
        yield f
    print(f.output)


def test_every_example_is_checked():
    assert sorted({h for h, _, _ in blocks()}) == sorted(EXPECT)


@pytest.mark.parametrize("heading, language, code", blocks(), ids=[b[0] for b in blocks()])
def test_example_runs(frontend, triton_server, tmp_path, heading, language, code):
    env = {**os.environ, "OMNISTAGE_URL": frontend.url, "TRITON_GRPC": triton_server.grpc_url}
    cmd = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files, needle = EXPECT[heading]
    assert needle in done.stdout, done.stdout[-2000:]
    for name in files:
        with wave.open(str(tmp_path / name)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert w.getnframes() > 1920  # at least a codec frame of speech
