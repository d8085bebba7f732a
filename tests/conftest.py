# Shared by every test directory: the `gpu` marker (skipped where torch sees no CUDA device) and
# the tiny random-weight checkpoint, made once per session.
import os

import pytest

# Triton kernels (omnistage/models/fused_ops.py) run in Triton's CPU interpreter here; set before any import
# of them, since @triton.jit reads it when a kernel is defined. The gpu-marked tests want compiled kernels:
# run them apart with TRITON_INTERPRET=0 (README.md, Tests)
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where torch sees none")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: importing torch costs seconds

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


from tests.model_fixtures import hf_model, processor, tiny_checkpoint  # noqa: E402,F401  (session fixtures)
