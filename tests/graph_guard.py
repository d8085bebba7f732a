# Test support: fails a CUDA-graph body (a function GraphBank.run / capture_all takes) on the CPU at every
# operation that CUDA-graph capture cannot record. On the CPU GraphBank runs its bodies eagerly, so the
# unit tests drive exactly the code a graph captures, but nothing there complains about a host sync.
# Out of its sight: branches taken on CUDA only (the fused Triton kernels, bucket padding), .to(device)
# copies (every tensor here is on the one device), the inside of a custom op (seen as one op), and the
# Python inside torch's own functions (seen only as the aten ops it reaches).
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.stages.cuda_graphs import GraphBank


class GraphCaptureError(AssertionError):
    pass


_HOST_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose"}
_VALUE_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                 "unique_consecutive", "bincount"}  # fmt: skip
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
_HOST_DATA = {"tensor", "as_tensor", "asarray", "from_numpy", "new_tensor"}
_TO_HOST = {"cpu", "numpy", "tolist", "item", "__int__", "__float__", "__bool__", "__index__"}
_FACTORIES = {"arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "randperm", "linspace",
              "logspace", "eye", "empty_strided"}  # fmt: skip
_TENSOR_REPEATS = (torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.repeat_interleave.self_Tensor)


def _list_index(index) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _TorchCalls(TorchFunctionMode):
    """Python-level calls: what leaves or enters the device before aten sees it (rules 1, 3, 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _TO_HOST:
            raise GraphCaptureError(f"{name}() reads a device tensor on the host inside a graph body")
        if name in _HOST_DATA:
            raise GraphCaptureError(f"{name}() copies host data into a graph body")
        if name in ("__getitem__", "__setitem__") and _list_index(args[1]):
            raise GraphCaptureError(f"{name} with a list index copies host data into a graph body")
        if name == "pin_memory" or kwargs.get("pin_memory"):
            raise GraphCaptureError("pinned memory allocated inside a graph body")
        if name in _FACTORIES and getattr(torch, name, None) is func and kwargs.get("device") is None:
            raise GraphCaptureError(f"torch.{name}() without device= makes a host tensor inside a graph body")
        return func(*args, **kwargs)


class _AtenOps(TorchDispatchMode):
    """aten ops, including those transformers' and torch's Python code reach (rules 1, 2)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            raise GraphCaptureError(f"aten.{name} syncs the host with the device inside a graph body")
        if name in _VALUE_SHAPED:
            raise GraphCaptureError(f"aten.{name} has an output shape that depends on device values")
        if name in _INDEXING and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            raise GraphCaptureError(f"aten.{name} with a boolean mask has a value-dependent shape (nonzero)")
        if name == "where" and len(args) == 1:
            raise GraphCaptureError("torch.where(condition) is nonzero: a value-dependent shape")
        if func in _TENSOR_REPEATS and kwargs.get("output_size") is None:
            raise GraphCaptureError("repeat_interleave with tensor repeats and no output_size syncs for its size")
        if name == "histc" and _histc_range(args, kwargs) == (0, 0):
            raise GraphCaptureError("histc without min/max reads the input's range on the host")
        return func(*args, **kwargs)


def _histc_range(args, kwargs) -> tuple:
    return (args[2] if len(args) > 2 else kwargs.get("min", 0), args[3] if len(args) > 3 else kwargs.get("max", 0))


def _no_sync(*args, **kwargs):
    raise GraphCaptureError("torch.cuda.synchronize() inside a graph body")


@contextlib.contextmanager
def graph_capture_guard() -> Iterator[None]:
    """While active, an operation that CUDA-graph capture cannot record raises GraphCaptureError. The rule:
    Inside a body every tensor stands for one on the graph's device; capture records kernels, and replay
    re-runs those kernels on whatever the static buffers hold. So a body may not:
    1. read a device value on the host (a sync: illegal during capture, and a decision baked into every
       replay): .item(), int()/float()/bool() of a tensor, `if tensor`, torch.equal/allclose, .tolist(),
       .cpu(), .numpy();
    2. make a shape from device values (the kernel sizing its output syncs to learn it): nonzero,
       torch.where(cond), boolean-mask indexing and index_put_, masked_select, unique, bincount,
       repeat_interleave with tensor repeats and no output_size, histc without an explicit range;
    3. bring host data in (torch.tensor/as_tensor/asarray/from_numpy, Tensor.new_tensor, an index that is a
       Python list): a copy from pageable memory, illegal during capture, whose values every replay repeats;
       nor allocate pinned memory (its allocator queries events, illegal during capture);
    4. make a tensor without naming its device (a factory such as torch.arange(n) without device=): on CUDA
       it is a host tensor, copied to the device from pageable memory where a kernel reads it. Factories with
       a device, *_like and Tensor.new_* (the source's device) are fine: a fill kernel on the device;
    5. synchronise explicitly (torch.cuda.synchronize).
    Host ints derived from shapes and Python arguments (bucket keys) are fine: they are fixed per graph.
    """
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = _no_sync
    try:
        with _TorchCalls(), _AtenOps():
            yield
    finally:
        torch.cuda.synchronize = synchronize


def guarded(fn: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(fn)
    def body():
        with graph_capture_guard():
            fn()

    return body


def guard_graph_bodies(monkeypatch) -> list[tuple[str, tuple]]:
    """Makes every GraphBank body run under graph_capture_guard; returns the list that each body run appends
    its (bank name, key as a tuple) to, so that a test can tell which bodies it drove."""
    ran: list[tuple[str, tuple]] = []
    run, capture_all = GraphBank.run, GraphBank.capture_all

    def guarded_run(bank, key, fn):
        ran.append((bank.name, key if isinstance(key, tuple) else (key,)))
        run(bank, key, guarded(fn))

    def guarded_capture_all(bank, keys, fn_for):
        capture_all(bank, keys, lambda key: guarded(fn_for(key)))

    monkeypatch.setattr(GraphBank, "run", guarded_run)
    monkeypatch.setattr(GraphBank, "capture_all", guarded_capture_all)
    return ran
