# What a server's process tree holds, read from /proc: used by the soak and fault tests to show that
# nothing leaks (threads, file descriptors, Triton's shared-memory regions) and to find the Python
# backend's stub processes (one per model instance) to kill them.
from __future__ import annotations

import os
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
