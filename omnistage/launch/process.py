# A child process for a local server: output to a log file, readiness by HTTP polling, staged stop.
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    pass


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    # All n sockets stay bound until all are chosen, so the n ports differ. Racy by nature (another
    # process may take one before the server binds); TritonServer checks its id once ready.
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _child_setup():
    """The preexec_fn for Popen: two libc calls, resolved here in the parent so that the child,
    between fork and exec, neither loads libraries nor runs Python that could take a lock."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc: no parent-death signal, default SIGINT handling as inherited
        return None
    prctl, set_handler = libc.prctl, libc.signal
    set_handler.argtypes = [ctypes.c_int, ctypes.c_void_p]
    pdeathsig = (ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM))  # prctl is variadic

    def setup() -> None:
        # A shell starts background jobs with SIGINT ignored, and exec keeps ignored signals
        # ignored: restore the default so that our staged stop (SIGINT first) works however we
        # were started.
        set_handler(signal.SIGINT, None)  # SIG_DFL
        # If we die (pytest timeout, SIGKILL), the kernel sends the child SIGTERM, so no server
        # outlives a crashed run holding its ports. It fires when the *thread* that forked exits:
        # start servers from a long-lived thread.
        prctl(*pdeathsig)

    return setup


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None, log_path: Path, cwd: Path | None = None):
        # env None: inherit ours
        self.name, self.argv, self.env, self.log_path, self.cwd = name, argv, env, Path(log_path), cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            # own session: a terminal's Ctrl-C reaches only us, and we stop children in a fixed order
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_child_setup(),  # noqa: PLW1509
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * lines))
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_http_ok(
        self,
        url: str,
        timeout: float,
        check: Callable[[], str | None] | None = None,
        progress: Callable[[str], None] | None = None,
        every: float = 5.0,
    ) -> float:
        """Polls url until it answers 200; returns the seconds waited.

        Raises ProcessFailed with the log tail when the process exits, when `check` returns an error
        text (e.g. a model failed to load), or on timeout.
        """
        start = last = time.monotonic()
        while True:
            waited = time.monotonic() - start
            exited = not self.alive()
            problem = check() if check else None  # also after an exit: it names the cause
            if exited:
                why = f"exited with code {self.poll()} after {waited:.1f}s" + (f": {problem}" if problem else "")
                raise ProcessFailed(self._failure(why))
            if problem:
                raise ProcessFailed(self._failure(problem))
            if _http_ok(url):
                return waited
            if waited > timeout:
                raise ProcessFailed(self._failure(f"not ready after {timeout:.0f}s ({url})"))
            if progress and time.monotonic() - last >= every:
                last = time.monotonic()
                progress(f"[{self.name}] waiting for {url} ({waited:.0f}s)")
            time.sleep(0.1 if waited < 2 else 0.25)

    def _failure(self, what: str) -> str:
        return f"{self.name} {what}; log {self.log_path}, last lines:\n{self.log_tail()}"

    def stop(self, grace: float = 15.0, term_grace: float = 5.0) -> int | None:
        """SIGINT (graceful: Triton drains in-flight requests), then SIGTERM, then SIGKILL."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                self.proc.send_signal(sig)
                self.proc.wait(wait)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] still running {wait:.0f}s after {sig.name}", file=sys.stderr)
        # Stragglers in the child's own session, e.g. Triton's Python stubs after a crash, which
        # otherwise linger for up to a minute before noticing their parent is gone.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.poll()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False
