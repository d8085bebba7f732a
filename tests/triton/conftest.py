# Real tritonserver fixtures. A test module names what to serve with a module-scoped `repo_spec`
# fixture; `triton_server` renders it into a temp dir, starts the bundled tritonserver on free
# loopback ports and yields a RunningTriton. Failing tests get the server log tail in their report.
from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omnistage.launch.render import ModelSpec, render_repository
from omnistage.launch.tritonserver import TritonServer

FIXTURES = Path(__file__).parent / "fixtures"
READY_TIMEOUT_S = 120.0  # 2 CPU cores: each Python model instance is a process importing numpy


@dataclass
class RepoSpec:
    models: dict[str, ModelSpec]
    src: Path = FIXTURES  # dir of <model>/1/model.py
    env: dict[str, str] | None = None  # tritonserver's environment before launch additions
    ready_timeout_s: float = READY_TIMEOUT_S  # more model instances (replicas) load for longer
    api_key: str | None = None  # Triton's inference and admin APIs locked behind it, as `serve` locks them


@dataclass
class RunningTriton:
    server: TritonServer
    _clients: list = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    def grpc_client(self):
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        self._clients.append(client)
        return client

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def log_tail(self, lines: int = 80) -> str:
        return self.server.log_tail(lines)

    def close(self) -> None:
        # Cancel first: stop_stream() without it waits for every open request of the stream, and a
        # test that failed half-way may have left one open.
        for client in self._clients:
            try:
                client.stop_stream(cancel_requests=True)
            except Exception:
                pass  # a stream already broken by the test must not hide the test's own failure
        self.server.stop()
        for client in self._clients:
            try:
                client.close()
            except Exception:
                pass
        self._clients.clear()


class Launcher:
    """launch(RepoSpec) -> RunningTriton for servers of one test's own; all stopped after it."""

    def __init__(self, workdir: Path):
        self.workdir, self.started = workdir, []

    def __call__(self, spec: RepoSpec) -> RunningTriton:
        return self.start_all([spec])[0]

    def start_all(self, specs: list[RepoSpec]) -> list[RunningTriton]:
        """Starts one server per spec, all at once (they load in parallel), then waits for each."""
        running = []
        for spec in specs:
            workdir = self.workdir / f"server{len(self.started)}"
            repo = render_repository(spec.src, workdir / "model_repository", spec.models)
            server = TritonServer.on_free_ports(repo, workdir / "run", env=spec.env, exit_timeout_s=3,
                                                api_key=spec.api_key)
            self.started.append(RunningTriton(server))  # before starting: its log is reported on failure
            running.append(self.started[-1])
            server.start()
        for spec, r in zip(specs, running):
            r.server.wait_ready(timeout=spec.ready_timeout_s)
        return running

    def close(self) -> None:
        for running in self.started:
            running.close()


@pytest.fixture(scope="module")
def triton_server(repo_spec: RepoSpec, tmp_path_factory) -> RunningTriton:
    launcher = Launcher(tmp_path_factory.mktemp("triton"))
    try:
        yield launcher(repo_spec)  # a start failure raises TritonStartError with the log tail
    finally:
        launcher.close()


@pytest.fixture
def triton_launcher(tmp_path) -> Launcher:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    args = getattr(item, "funcargs", {})
    servers = [args["triton_server"]] if isinstance(args.get("triton_server"), RunningTriton) else []
    if isinstance(args.get("triton_launcher"), Launcher):
        servers += args["triton_launcher"].started
    for running in servers:
        report.sections.append((f"tritonserver log {running.server.log_path}", running.log_tail()))
