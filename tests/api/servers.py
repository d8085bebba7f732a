# Real HTTP servers for the tests: uvicorn serving an app in a background thread of the test process
# (the fake backend stays inspectable), and `python -m openai_frontend` as a subprocess.
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedUvicorn:
    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # The session's shared clients (conftest) keep their connections across tests. With uvicorn's 5 s
        # keep-alive, an idle gap near 5 s races the server's close against the next request (a reset).
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=3600)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadedUvicorn:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class FrontendProcess:
    """`python -m openai_frontend ARGS` on a free port; its log is kept in `output` for failure reports."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.extra_env = env or {}  # on top of this process's environment
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Tests reuse one client across pauses; an hour's keep-alive keeps a pause from racing the server's
        # close (see ThreadedUvicorn). A test that passes its own --keep-alive-timeout wins (argparse keeps the last).
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--keep-alive-timeout", "3600", *args]
        self.output = ""

    def __enter__(self) -> FrontendProcess:
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openai_frontend", *self.args],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **self.extra_env}, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"frontend exited early:\n{self.read_log()}")
            try:
                httpx.get(f"{self.url}/v1/models", timeout=1)
                return self
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"frontend did not start:\n{self.output}") from None
                time.sleep(0.05)

    def read_log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __exit__(self, *_) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.output = self.read_log()
        self.log.close()
