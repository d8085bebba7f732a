# What a server's process tree holds, read from /proc: used by the soak and fault tests to show that
# nothing leaks (threads, file descriptors, Triton's shared-memory regions) and to find the Python
# backend's stub processes (one per model instance) to kill them.
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def stub_pids(server_pid: int) -> dict[str, list[int]]:
    """model name -> pids of its Python-backend stubs (argv[1] is <repository>/<model>/<version>/model.py)."""
    stubs: dict[str, list[int]] = {}
    for pid in children(server_pid):
        argv = cmdline(pid)
        if len(argv) > 1 and argv[0].endswith("triton_python_backend_stub"):
            stubs.setdefault(Path(argv[1]).parent.parent.name, []).append(pid)
    return stubs


def dump_stub_stacks(server_pid: int) -> int:
    """SIGUSR1 to every stub of a server: faulthandler writes all their threads' stacks into the server log,
    or into OMNI_STACKS_DIR (omnistage/triton/logs.py). Returns how many stubs were signalled."""
    pids = [pid for group in stub_pids(server_pid).values() for pid in group]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # gone since it was listed
            pass
    return len(pids)


def native_stacks(pid: int, timeout_s: float = 60.0) -> str:
    """Every thread's native stack (gdb, where installed; "" without it): where a stub's threads wait inside the
    backend's C++ (a mutex, the GIL, a shared-memory queue), which the Python stacks of dump_stub_stacks stop
    short of. gdb stops the process while it reads them, seconds on a busy host: Triton may take a stub
    stopped that long for dead, so this is for a run that is lost already."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:
        run = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"], capture_output=True,
                             text=True, timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"gdb -p {pid}: no stacks within {timeout_s:.0f}s\n"
    return run.stdout + run.stderr


def process_state(pid: int) -> dict[str, str]:
    """A process's scheduler state as /proc shows it (R running, S sleeping, D uninterruptible: waiting in the
    kernel or a driver, where it does not even take signals, Z exited and not yet reaped), the kernel
    function it waits in and its thread count (a pool that ran dry shows as a plateau);
    {"state": "gone"} for a pid that does not exist."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return {"state": "gone"}
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return {"state": state, "wchan": wchan, "threads": str(_count(f"/proc/{pid}/task"))}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def server_cpu_seconds(server_pid: int, frontend_pid: int | None = None) -> dict[str, float]:
    """CPU seconds per part of a served stack: tritonserver itself, each model's stubs summed, the frontend.
    A part that uses about one core's worth over a period is bound by its GIL."""
    out = {"tritonserver": cpu_seconds(server_pid)}
    for model, pids in stub_pids(server_pid).items():
        out[model] = sum(cpu_seconds(p) for p in pids)
    if frontend_pid is not None:
        out["openai_frontend"] = cpu_seconds(frontend_pid)
    return out


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def _shm_mapped(pid: int) -> set[str]:
    # /dev/shm is shared with every other server on the host: count only what this tree maps
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in lines if "/dev/shm/" in line}


def tree_stats(pid: int) -> dict[str, int]:
    """Threads and open fds of a process and its children (the stubs), and the shm segments they map."""
    pids = [pid, *children(pid)]
    return {
        "processes": len(pids),
        "threads": sum(_count(f"/proc/{p}/task") for p in pids),
        "fds": sum(_count(f"/proc/{p}/fd") for p in pids),
        "shm_segments": len(set().union(*(_shm_mapped(p) for p in pids))),
    }


def listening_addresses(pid: int) -> set[str]:
    """host:port of every TCP socket the process (and its children) listens on, e.g. {"127.0.0.1:8000"}."""
    inodes = set()
    for p in (pid, *children(pid)):
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                target = os.readlink(f"/proc/{p}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                host, port = cols[1].split(":")
                found.add(f"{_ip(host, width)}:{int(port, 16)}")
    return found


def _ip(hex_host: str, width: int) -> str:
    raw = bytes.fromhex(hex_host)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])  # little-endian IPv4
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # IPv6: four little-endian 32-bit words
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))
