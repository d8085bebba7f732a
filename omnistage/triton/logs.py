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
    # `kill -USR1 <stub pid>` prints every thread's stack into the server log: how a hung stub is diagnosed
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
