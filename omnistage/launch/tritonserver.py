# Runs one tritonserver process over a rendered model repository.
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from omnistage.launch.process import ManagedProcess, ProcessFailed, free_port, free_ports, port_in_use
from omnistage.launch.triton_env import REPO_ROOT, TritonInstall, locate_triton, prepare_backends, server_env
from omnistage.core.protocol import TRITON_GRPC_KEY_HEADER, TRITON_KEY_HEADER
from omnistage.triton.workarounds import STALE_STUB_GRACE_SECONDS, python_backend_args, stale_stubs

__all__ = ["TritonServer", "TritonStartError", "free_port", "free_ports"]

# e.g. "E1202 ... model_lifecycle.cc:654] failed to load 'broken' version 1: Internal: RuntimeError: ..."
_LOAD_FAILED = re.compile(r"failed to load '([^']+)'[^\n]*")
# a load's start and end in the log: a model being reloaded stays READY in Triton's index meanwhile
_LOAD_EVENT = re.compile(r"\"loading: ([^:\"]+):\d+\"|successfully loaded '([^']+)'|failed to load '([^']+)'")


# With a key, these APIs of Triton's HTTP and gRPC ports answer only requests that carry it in
# TRITON_KEY_HEADER (Triton's --http-restricted-api / --grpc-restricted-protocol); health, metadata, model
# config and statistics stay open. Model control matters most: `load` with an uploaded model.py runs code
# as the server's user.
RESTRICTED = ("model-repository", "shared-memory", "trace", "logging")
RESTART_ATTEMPTS = 3


class TritonStartError(ProcessFailed):
    pass


class TritonServer:
    def __init__(
        self,
        model_repository: Path,
        run_dir: Path,
        *,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        gpus: Sequence[int] = (),  # non-empty when models run on cuda: each gets a larger CUDA pool
        cuda_pool_bytes: int = 1 << 30,
        exit_timeout_s: int = 10,
        # explicit: the frontend's watchdog can reload a model whose Python stub died (load_model), which
        # Triton 2.51 never does by itself; "*" loads every model at startup, as mode "none" would
        model_control_mode: str = "explicit",
        load_models: Sequence[str] = ("*",),  # explicit mode only
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        # the stub puts its working directory first on sys.path: the repo root makes `import
        # omnistage` work in model.py even where the checkout is not pip-installed
        cwd: Path = REPO_ROOT,
        install: TritonInstall | None = None,
        # None: every API open (tests that drive Triton directly); see RESTRICTED
        api_key: str | None = None,
        restrict_inference: bool = True,  # with api_key: inference needs the key as well
        # A reload of a model whose stub died or stopped with requests in flight leaves an instance that never
        # unloads (~515 backend threads, its shm region, a stopped stub's memory; workarounds.py, 9): once this
        # many exist, or one has for stale_restart_s, the server is restarted (the frontend answers 503 +
        # Retry-After meanwhile): several faults in a row cost one restart, and none leaves its instance for
        # good. 0: never.
        restart_after_stale: int = 2,
        stale_restart_s: float = 300.0,
        # A server that exits by itself once it has been ready is started again on the same ports with the same
        # key (Triton aborts as a whole on some stub faults: workarounds.py, 13). False: an exit is final.
        restart_on_exit: bool = True,
    ):
        self.model_repository, self.run_dir = Path(model_repository), Path(run_dir)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.gpus, self.cuda_pool_bytes, self.exit_timeout_s = tuple(gpus), cuda_pool_bytes, exit_timeout_s
        self.model_control_mode, self.load_models, self.extra_args = model_control_mode, tuple(load_models), tuple(extra_args)
        self.base_env, self.cwd = env, Path(cwd)
        self.install = install or locate_triton()
        self.api_key, self.restrict_inference = api_key, restrict_inference
        self.process: ManagedProcess | None = None
        self._log_offset = 0
        self._stop_supervising = threading.Event()
        self.restart_after_stale, self.stale_restart_s, self.restarts = restart_after_stale, stale_restart_s, 0
        self._stale: dict[int, float] = {}  # stub pid -> time.monotonic() it was first seen stale
        self._dead: dict[int, float] = {}  # unreaped dead stub pid -> when it was first seen (stale_stubs)
        self._left: dict[int, float] = {}  # replaced instance's stub pid -> since when, with every model READY
        self._loading: set[str] = set()  # models whose load the log shows begun and not ended
        self._events_offset = 0  # how far the log has been read for those
        self.ready_timeout_s = 300.0
        self._lifecycle = threading.Lock()  # a restart and stop() one at a time
        self._restarting = False  # a restart in progress: alive() stays true for the launcher
        self.restart_on_exit = restart_on_exit
        self._ready_once = False  # an exit before the first ready is a failed start, not restarted
        self._supervising = False  # the supervisor thread runs: an exit it has not seen yet is still restarted
        self._launch: tuple[list[str], dict[str, str]] | None = None  # argv and environment, for restarts
        # checked against GET /v2 once ready, so that a leftover server on our ports can't pass as us
        self.server_id = f"omnistage-{os.getpid()}-{http_port}"

    @classmethod
    def on_free_ports(cls, model_repository: Path, run_dir: Path, **kw) -> TritonServer:
        http, grpc, metrics = free_ports(3, kw.get("host", "127.0.0.1"))
        return cls(model_repository, run_dir, http_port=http, grpc_port=grpc, metrics_port=metrics, **kw)

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:  # tritonclient.grpc spelling: host:port, no scheme
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "tritonserver.log"

    def argv(self, backends: Path) -> list[str]:
        args = [
            str(self.install.server),
            f"--id={self.server_id}",
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={self.model_control_mode}",
            "--log-verbose=0",
            # our configs are complete; auto-complete would let the backend fill in defaults silently
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        args += [f"--load-model={m}" for m in self.load_models]
        # omni_ensemble caps its requests in flight (max_inflight) to stay under the BLS thread pool set here
        args += python_backend_args(self.gpus)
        # GPU tensors between the Python backend and the server go through this pool; Triton's 64 MB
        # default is smaller than one batch of stage tensors (hidden states, codec frames).
        args += [f"--cuda-memory-pool-byte-size={g}:{self.cuda_pool_bytes}" for g in self.gpus]
        if self.api_key:
            apis = ",".join(RESTRICTED + (("inference",) if self.restrict_inference else ()))
            # the key is in argv (visible to local users through ps); the ports bind loopback by default
            args += [f"--http-restricted-api={apis}:{TRITON_KEY_HEADER}={self.api_key}",
                     f"--grpc-restricted-protocol={apis}:{TRITON_KEY_HEADER}={self.api_key}"]  # fmt: skip
        return args + list(self.extra_args)

    @property
    def grpc_headers(self) -> dict[str, str]:
        """What a gRPC client of this server's restricted APIs sends with every call."""
        return {TRITON_GRPC_KEY_HEADER: self.api_key} if self.api_key else {}

    def start(self) -> None:
        busy = [p for p in (self.http_port, self.grpc_port, self.metrics_port) if port_in_use(p, self.host)]
        if busy:
            raise TritonStartError(f"port(s) {busy} on {self.host} already in use (a leftover tritonserver?)")
        backends = prepare_backends(self.install, self.run_dir / "triton")
        self.log_path.unlink(missing_ok=True)
        self._launch = self.argv(backends), server_env(self.install, self.base_env)
        self._log_offset = self._events_offset = 0
        self._spawn()
        self._stop_supervising.clear()
        self._supervising = True
        threading.Thread(target=self._supervise, name="triton-supervisor", daemon=True).start()

    def _spawn(self) -> None:
        argv, env = self._launch
        self.process = ManagedProcess("tritonserver", argv, env, self.log_path, cwd=self.cwd)
        self.process.start()

    def _supervise(self) -> None:
        try:
            self._supervise_loop()
        finally:
            self._supervising = False

    def _supervise_loop(self) -> None:
        """Restarts the server once it has exited by itself (restart_on_exit; workarounds.py, 13), and once
        instances that a reload replaced have not unloaded (workarounds.py, 9): restart_after_stale of them, or
        one for stale_restart_s. A replaced instance's stub (stale_stubs) counts once it has outlived
        STALE_STUB_GRACE_SECONDS with every model READY: a normal unload ends within seconds of its
        replacement's load, which itself may take minutes. Their stubs are left alone until then: killing a stub
        while Triton finalizes its instance aborts tritonserver."""
        while not self._stop_supervising.wait(2.0):
            if not self.process.alive():
                if not (self._ready_once and self.restart_on_exit):
                    return
                self._restart(f"exited with code {self.process.poll()}")
                if not self.process.alive():
                    return  # every attempt failed: alive() turns false and the launcher gives up
                continue
            now, left = time.monotonic(), stale_stubs(self.process.pid, self._dead, grace_s=0)
            ready = self._models_ready()
            self._left = {pid: self._left.get(pid, now) if ready else now for pid in left}
            stale = [pid for pid, since in self._left.items() if now - since >= STALE_STUB_GRACE_SECONDS]
            for pid in set(stale) - self._stale.keys():
                print(f"[tritonserver] stub {pid}: its instance was reloaded and has not unloaded", file=sys.stderr)
            self._stale = {pid: self._stale.get(pid, now) for pid in stale}  # one that unloaded after all goes
            oldest = min(self._stale.values(), default=now)
            if self.restart_after_stale and self._stale and (len(self._stale) >= self.restart_after_stale
                                                             or now - oldest >= self.stale_restart_s):  # fmt: skip
                self._restart(f"{len(self._stale)} reloaded instances never unloaded")

    def _models_ready(self) -> bool:
        """Every model of the repository READY (none failed or unloading, as Triton's index says) and no load
        in progress (as its log says: a reloaded model stays READY in the index while its new instance loads)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._events_offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
        self._events_offset += end
        for began, loaded, failed in _LOAD_EVENT.findall(chunk[:end].decode(errors="replace")):
            if began:
                self._loading.add(began)
            self._loading.discard(loaded or failed)
        if self._loading:
            return False
        request = urllib.request.Request(f"{self.http_url}/v2/repository/index", data=b"{}", method="POST",
                                         headers={TRITON_KEY_HEADER: self.api_key} if self.api_key else {})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                models = json.load(r)
        except (OSError, ValueError):
            return False
        return bool(models) and all(m.get("state") == "READY" for m in models)

    def _restart(self, why: str) -> None:
        """Stops the server and starts it again, up to RESTART_ATTEMPTS times until one start gets ready (on a
        starved host a start can fail inside the Python backend); alive() stays true meanwhile."""
        print(f"[tritonserver] restarting: {why}", file=sys.stderr)
        self._restarting = True
        try:
            for attempt in range(1, RESTART_ATTEMPTS + 1):
                with self._lifecycle:
                    if self._stop_supervising.is_set():
                        return
                    # instances that never unload keep it from exiting by itself once its exit timeout has passed
                    self.process.stop(grace=self.exit_timeout_s + 1.0, term_grace=2.0)
                    self._stale, self._dead, self._left, self._loading = {}, {}, {}, set()
                    self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
                    self._events_offset = self._log_offset
                    # forked from this thread, which lives as long as the server is ours: the parent-death
                    # signal (process.py) fires when the forking thread exits
                    self._spawn()
                try:
                    waited = self.wait_ready(self.ready_timeout_s)
                    print(f"[tritonserver] restarted, ready in {waited:.1f}s", file=sys.stderr)
                    return
                except TritonStartError as e:
                    print(f"[tritonserver] restart {attempt} of {RESTART_ATTEMPTS} failed: {e}", file=sys.stderr)
        finally:
            self._restarting = False
            self.restarts += 1

    def wait_ready(self, timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> float:
        assert self.process is not None, "start() first"
        self.ready_timeout_s = timeout  # a restart gets as long as the first start
        try:
            waited = self.process.wait_http_ok(f"{self.http_url}/v2/health/ready", timeout, self._load_failure, progress)
        except ProcessFailed as e:
            raise TritonStartError(str(e)) from None
        with urllib.request.urlopen(f"{self.http_url}/v2", timeout=5) as r:
            answered = json.load(r).get("name")
        if answered != self.server_id:
            raise TritonStartError(f"{self.http_url} is served by {answered!r}, not by the server we started")
        self._ready_once = True
        return waited

    def _load_failure(self) -> str | None:
        # Triton keeps starting the other models (and only then exits) after one fails; reading the
        # log reports the failing model at once and by name.
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except FileNotFoundError:
            return None
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
        self._log_offset += end
        m = _LOAD_FAILED.search(chunk[:end].decode(errors="replace"))
        return f"model {m.group(1)!r} failed to load: {m.group(0)}" if m else None

    def start_and_wait(self, timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> float:
        self.start()
        try:
            return self.wait_ready(timeout, progress)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines) if self.process else ""

    def alive(self) -> bool:
        """The server runs, or is being restarted by its supervisor (an exit it has not seen yet included)."""
        if self._restarting or (self.process is not None and self.process.alive()):
            return True
        return self._supervising and self._ready_once and self.restart_on_exit and not self._stop_supervising.is_set()

    def stop(self) -> int | None:
        self._stop_supervising.set()
        with self._lifecycle:
            if self.process is None:
                return None
            return self.process.stop(grace=self.exit_timeout_s + 5.0)

    def __enter__(self) -> TritonServer:
        self.start_and_wait(progress=lambda m: print(m, file=sys.stderr))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
