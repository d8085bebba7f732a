# Reads one stage's tensors from a HF safetensors checkpoint into an already-allocated module,
# converting the released per-expert MoE layout to transformers 5.17's fused expert parameters:
#   <p>.experts.<e>.gate_proj.weight [I, H] -> <p>.experts.gate_up_proj[e, :I]   ([E, 2I, H])
#   <p>.experts.<e>.up_proj.weight   [I, H] -> <p>.experts.gate_up_proj[e, I:]
#   <p>.experts.<e>.down_proj.weight [H, I] -> <p>.experts.down_proj[e]          ([E, H, I])
# Tensors are copied straight into the parameters' storage (no stacked copies of a whole layer).
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class CheckpointMismatchError(RuntimeError):
    pass


def tensor_files(directory: Path) -> dict[str, Path]:
    # name -> shard file, from the index when sharded, else from the single file's header.
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _destination(key: str, targets: dict[str, torch.Tensor]):
    # -> (target key, view to copy into, slot) or None when the key has no home in the module.
    m = _EXPERT.match(key)
    if m is None:
        return (key, targets[key], None) if key in targets else None
    fused = f"{m['base']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
    param, e = targets.get(fused), int(m["e"])
    if param is None or param.dim() != 3 or e >= param.shape[0]:
        return None
    half = param.shape[1] // 2
    view = {"gate_proj": param[e, :half], "up_proj": param[e, half:], "down_proj": param[e]}[m["proj"]]
    return fused, view, (e, m["proj"])


def _slots_needed(key: str, param: torch.Tensor, slots: set) -> bool:
    # True when a fused expert tensor got every per-expert piece (or was stored fused).
    if None in slots:
        return True
    parts = ("down_proj",) if key.endswith(".down_proj") else ("gate_proj", "up_proj")
    return slots == {(e, p) for e in range(param.shape[0]) for p in parts}


@torch.no_grad()
def load_prefixed_(module: nn.Module, directory: Path, prefix: str) -> None:
    """Fill `module` (params and persistent buffers) from the checkpoint tensors named `<prefix>.*`."""
    files = {k[len(prefix) + 1:]: f for k, f in tensor_files(directory).items() if k.startswith(prefix + ".")}
    targets = module.state_dict(keep_vars=True)  # live tensors, persistent entries only
    filled, unexpected, by_file = defaultdict(set), [], defaultdict(list)
    for key, file in files.items():
        by_file[file].append(key)

    from safetensors import safe_open

    for file, keys in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            for key in sorted(keys):
                dest = _destination(key, targets)
                if dest is None:
                    unexpected.append(key)
                    continue
                target, view, slot = dest
                tensor = f.get_tensor(f"{prefix}.{key}")
                if tuple(tensor.shape) != tuple(view.shape):
                    raise CheckpointMismatchError(
                        f"{prefix}.{key}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(view.shape)}")
                view.copy_(tensor)  # casts to the module's dtype / device
                filled[target].add(slot)

    tied = set(getattr(module, "all_tied_weights_keys", None) or {})  # filled by tie_weights() instead
    missing = sorted(k for k, t in targets.items()
                     if k not in tied and not (k in filled and _slots_needed(k, t, filled[k])))
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{directory} does not match the {prefix} module: "
            f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {sorted(unexpected)[:8]}")
    if tied:
        module.tie_weights()
