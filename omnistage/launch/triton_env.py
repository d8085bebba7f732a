# Where tritonserver and its backends live, and the environment it (and the Python backend stub it
# spawns per model instance) must run in.
#
# Two sources: a prepared machine sets TRITONSERVER (binary) and TRITON_BACKENDS (backends dir);
# otherwise both come from the nvidia-pytriton wheel, which ships tritonserver 2.51 but keeps one
# Python backend stub per Python version aside, under python_backend_stubs/3.X/.
#
# `python -m omnistage.launch.triton_env` prints that environment as shell exports, for running
# tritonserver by hand over the checked-in repository (from the repository root):
#   eval "$(.venv/bin/python -m omnistage.launch.triton_env)"
#   "$TRITONSERVER" --model-repository=model_repository --backend-directory="$TRITON_BACKENDS" \
#       --backend-config=python,thread-pool-size=512
from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

STUB = "triton_python_backend_stub"

# glibc's allocator, for tritonserver and the stubs (a deployer's own values win). By default every thread
# that allocates gets an arena of its own, up to 8 per core, and an arena keeps most of what is freed into it:
# with hundreds of short-lived threads (the Python backend's BLS pool, omni_ensemble's request threads) RSS
# grows with each arena a new thread touches. Two arenas bound that (the GIL serialises most allocations
# anyway). Blocks of 1 MiB and more (prompts, media, features, audio) are mapped and unmapped on their own,
# instead of the threshold creeping up to 32 MiB after large frees and leaving them in the heap; free memory
# at the heap's top goes back to the OS past 16 MiB.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 20)}
REPO_ROOT = Path(__file__).resolve().parents[2]


class TritonNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    server: Path  # the tritonserver binary
    backends: Path  # as shipped; may lack backends/python/<STUB>
    stubs: Path | None  # <wheel>/python_backend_stubs, when the wheel is there
    libs: Path | None  # the wheel's bundled shared libraries (nvidia_pytriton.libs)


def _wheel_root() -> Path | None:
    # find_spec instead of `import pytriton`: importing it pulls in its whole client stack
    from importlib.util import find_spec

    spec = find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_triton(environ: dict[str, str] | None = None) -> TritonInstall:
    env = os.environ if environ is None else environ
    wheel = _wheel_root()
    bundled = wheel / "tritonserver" if wheel else None
    server = Path(env["TRITONSERVER"]) if env.get("TRITONSERVER") else (bundled / "bin" / "tritonserver" if bundled else None)
    backends = Path(env["TRITON_BACKENDS"]) if env.get("TRITON_BACKENDS") else (bundled / "backends" if bundled else None)
    if server is None or backends is None:
        raise TritonNotFound("no tritonserver: set TRITONSERVER and TRITON_BACKENDS, or pip install nvidia-pytriton==0.7.0")
    if not os.access(server, os.X_OK):
        raise TritonNotFound(f"tritonserver is not an executable file: {server}")
    if not (backends / "python").is_dir():
        raise TritonNotFound(f"no python backend under {backends}")
    stubs = bundled / "python_backend_stubs" if bundled and (bundled / "python_backend_stubs").is_dir() else None
    libs = wheel.parent / "nvidia_pytriton.libs" if wheel and (wheel.parent / "nvidia_pytriton.libs").is_dir() else None
    return TritonInstall(server=server, backends=backends, stubs=stubs, libs=libs)


def prepare_backends(install: TritonInstall, run_dir: Path) -> Path:
    """A backends dir whose python/ holds the stub for this interpreter's Python version.

    Built as a folder of symlinks under run_dir rather than by writing into site-packages (which may
    be read-only, shared between venvs, or reinstalled under us). Symlinks, not copies: the stub's
    RPATH ($ORIGIN/../../../../nvidia_pytriton.libs) is resolved from its real location, so it keeps
    finding its libraries, and the overlay is rebuilt idempotently in a few syscalls.
    """
    shipped = install.backends / "python" / STUB
    if shipped.exists():
        return install.backends  # a prepared install: use it as it is
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = install.stubs / version / STUB if install.stubs else None
    if stub is None or not stub.exists():
        raise TritonNotFound(f"no {STUB} for Python {version} (looked in {install.stubs})")

    out = run_dir / "backends"
    python_dir = out / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {e.name: e for e in install.backends.iterdir() if e.name != "python"}
    for name, target in links.items():
        _symlink(out / name, target)
    for entry in (install.backends / "python").iterdir():
        if entry.name != "__pycache__":
            _symlink(python_dir / entry.name, entry)
    _symlink(python_dir / STUB, stub)
    return out


def _symlink(link: Path, target: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target.resolve():
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target.resolve())


def _prepend(value: str | None, *paths: Path | str | None) -> str:
    parts = [str(p) for p in paths if p]
    parts += [p for p in (value or "").split(os.pathsep) if p and p not in parts]
    return os.pathsep.join(parts)


def python_libdir() -> Path | None:
    """Dir of the libpython the stub must load: the one of the interpreter that made the venv.

    The stub links libpython3.X.so.1.0 by soname; without this the loader may pick the distro's
    (here Debian's 3.11.2 while the venv runs pyenv's 3.11.7), and extension modules built against
    the newer one fail (`_ssl`: undefined symbol _PyModule_Add).
    """
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).exists():
        return Path(libdir)
    return None


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # The stub embeds Python and finds its prefix (hence the venv's site-packages) by looking up
    # `python3` on PATH: the interpreter running us must come first.
    env["PATH"] = _prepend(env.get("PATH"), os.path.dirname(sys.executable))
    env["LD_LIBRARY_PATH"] = _prepend(env.get("LD_LIBRARY_PATH"), python_libdir(), install.libs)
    # No PYTHONPATH: the 2.51 stub runs Python isolated (sys.flags.isolated == 1) and ignores it.
    # model.py files import omnistage through the venv (`pip install -e .`, whose .pth the stub does
    # read) or through the server's working directory, which is sys.path[0] ("") in the stub.
    env.setdefault("PYTHONUNBUFFERED", "1")  # model prints reach the server log as they happen
    env.update({k: v for k, v in MALLOC_ENV.items() if k not in env})
    return env


def shell_exports(run_dir: Path = REPO_ROOT / ".run" / "triton") -> str:
    """The launcher's environment as `export` lines: the binary, a backends dir with this Python's stub
    (prepared under run_dir), the PATH / LD_LIBRARY_PATH the stub needs and the allocator's settings."""
    import shlex

    install = locate_triton()
    backends = prepare_backends(install, run_dir)
    env = server_env(install)
    values = {"TRITONSERVER": str(install.server), "TRITON_BACKENDS": str(backends), "PATH": env["PATH"],
              "LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"], "PYTHONUNBUFFERED": env["PYTHONUNBUFFERED"],
              **{k: env[k] for k in MALLOC_ENV}}  # fmt: skip
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items())


if __name__ == "__main__":
    print(shell_exports(), end="")
