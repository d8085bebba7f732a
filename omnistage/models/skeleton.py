# Stage modules built without weights: structure on the meta device, then storage on the target
# device, then the non-persistent buffers (rotary inv_freq, audio sinusoids, code2wav code_offset)
# recomputed exactly as from_pretrained does. Nothing full-size ever lands on the CPU.
import math

import torch
from torch import nn


def build_on_meta(cls, config, dtype: torch.dtype, **impl) -> nn.Module:
    # _from_config(dtype=...) sets the default dtype while constructing, so parameters come out in
    # `dtype` while rotary / sinusoid buffers, created with explicit float32, stay float32 (as with
    # from_pretrained). model.to(dtype) would cast those buffers too. On meta, post_init skips init.
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype, **{k: v for k, v in impl.items() if v is not None})


def owned_modules(root: nn.Module):
    # Yields (module, nearest enclosing PreTrainedModel): composite models dispatch init per sub-model,
    # and each sub-model's config holds the initializer range and its own geometry.
    from transformers import PreTrainedModel

    stack = [(root, root)]
    while stack:
        module, owner = stack.pop()
        if isinstance(module, PreTrainedModel):
            owner = module
        yield module, owner
        stack.extend((child, owner) for child in reversed(list(module.children())))


def _non_persistent(module: nn.Module) -> list[str]:
    return [n for n, b in module.named_buffers(recurse=False) if b is not None and n in module._non_persistent_buffers_set]


@torch.no_grad()
def materialize_buffers_(model: nn.Module) -> None:
    # Poison first so a buffer that no init routine writes is caught, not silently left as garbage.
    for module, owner in owned_modules(model):
        names = _non_persistent(module)
        if not names:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            # _init_weights on a module with its own parameters would re-draw them too.
            raise RuntimeError(f"{type(module).__name__} owns both parameters and non-persistent buffers")
        for name in names:
            buf = getattr(module, name)
            buf.fill_(math.nan if buf.is_floating_point() else -1)
        owner._init_weights(module)  # transformers' own recipe for these buffers
        for name in names:
            buf = getattr(module, name)
            bad = torch.isnan(buf).any() if buf.is_floating_point() else (buf == -1).any()
            if bad:
                raise RuntimeError(f"no init routine for buffer {name} of {type(module).__name__}")


def empty_stage(cls, config, dtype: torch.dtype, device, **impl) -> nn.Module:
    model = build_on_meta(cls, config, dtype, **impl)
    model.to_empty(device=torch.device(device))
    materialize_buffers_(model)
    return model
