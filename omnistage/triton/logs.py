# Python logging of the stage processes into tritonserver's log: the stub's stderr is the server's, so a
# plain stream handler is enough. Level from OMNI_LOG_LEVEL (default INFO). SIGUSR1 dumps all stacks.
import faulthandler
import logging
import os
import signal
import sys


def setup_logging() -> None:
    root = logging.getLogger("omnistage")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("OMNI_LOG_LEVEL", "INFO"))
    root.propagate = False
    # `kill -USR1 <stub pid>` prints every thread's stack into the server log: how a hung stub is diagnosed.
    # With OMNI_STACKS_DIR set, each stub writes them to its own file there instead (stubs dumping at once
    # interleave their lines in the shared log).
    stacks_dir = os.environ.get("OMNI_STACKS_DIR")
    if stacks_dir:
        os.makedirs(stacks_dir, exist_ok=True)
        out = open(os.path.join(stacks_dir, f"stub-{os.getpid()}.txt"), "w", buffering=1)  # noqa: SIM115 (lives with the process)
        with open("/proc/self/cmdline", "rb") as f:  # the stub's command line names its model.py
            out.write(f.read().replace(b"\0", b" ").decode(errors="replace") + "\n")
    else:
        out = sys.stderr
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    # a stub that dies in native code (segfault, abort) leaves Python stacks instead of nothing: Triton
    # 2.51 neither logs a stub's death nor restarts it
    faulthandler.enable(file=out, all_threads=True)


def stop_fault_reports() -> None:
    """Called at the end of finalize(): the 2.51 stub tears its shared memory down before the interpreter,
    so every stub segfaults while collecting garbage at exit. That is not a fault of serving; do not
    report it as one."""
    faulthandler.disable()
