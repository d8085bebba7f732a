# `python -m omnistage.launch.serve` stopped by SIGTERM while a spoken reply streams: the reply still
# completes (drained), then the frontend and tritonserver exit, every port is free again, exit code 0.
import signal
import subprocess
import sys
import threading
import time

import httpx

from omnistage.launch.process import free_ports, port_in_use
from omnistage.launch.triton_env import REPO_ROOT


def test_sigterm_drains_then_stops_frontend_and_triton(tiny_checkpoint, tmp_path):
    api, http, grpc, metrics = ports = free_ports(4)
    log = open(tmp_path / "serve.log", "w+")
    serve = subprocess.Popen(
        [sys.executable, "-m", "omnistage.launch.serve", "--model", str(tiny_checkpoint), "--device", "cpu",
         "--api-port", str(api), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--run-dir", str(tmp_path / "run"), "--drain-timeout", "60"],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "[serve] ready" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        lines: list[str] = []
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 60, "stream": True,
                "sampling_params_list": [{"ignore_eos": True}, {"max_tokens": 40, "ignore_eos": True}]}  # fmt: skip

        def stream():
            with httpx.stream("POST", f"http://127.0.0.1:{api}/v1/chat/completions", json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data:"))

        reader = threading.Thread(target=stream)
        reader.start()
        while len(lines) < 3:
            assert reader.is_alive(), lines
            time.sleep(0.05)
        serve.send_signal(signal.SIGTERM)
        reader.join(120)
        assert serve.wait(120) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
    out = (tmp_path / "serve.log").read_text()
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    assert "draining in-flight requests" in out and "[serve] stopped" in out, out[-2000:]
    assert not any(port_in_use(p) for p in ports), "a port is still bound after serve exited"
