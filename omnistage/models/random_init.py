# Seeded random weights, drawn in place on whatever device the module lives on, following the
# model's own _init_weights recipe: normal(0, initializer_range) for matrices, embeddings, routers and
# experts; ones/zeros for norms; constructor values for SnakeBeta, layer scale and ConvNeXt gamma.
# Unlike _from_config in transformers 5.17 this also covers the talker's routed experts and
# routers (left torch.empty / zeros there). Unknown parameters fail loudly.
import torch
from torch import nn

from omnistage.models.skeleton import owned_modules

_NORMAL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.Embedding)
_NORM_MODULES = (nn.LayerNorm, nn.GroupNorm)


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, _NORM_MODULES) or "LayerNorm" in name or "RMSNorm" in name


def _config_value(owner: nn.Module, name: str, default):
    value = getattr(owner.config, name, None)
    return default if value is None else value


@torch.no_grad()
def _init_module(module: nn.Module, owner: nn.Module, gen: torch.Generator) -> None:
    params = dict(module.named_parameters(recurse=False))
    if not params:
        return
    std = _config_value(owner, "initializer_range", 0.02)
    kind = type(module).__name__
    for name, p in params.items():
        if isinstance(module, _NORMAL_MODULES) or kind.endswith("Experts") or kind.endswith("TopKRouter"):
            if name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
        elif _is_norm(module):
            p.fill_(1.0 if name == "weight" else 0.0)
        elif kind.endswith("SnakeBeta"):
            p.zero_()  # alpha, beta are log-scales: exp(0) = 1
        elif kind.endswith("LayerScale"):
            p.fill_(_config_value(owner, "layer_scale_initial_scale", 0.01))
        elif kind.endswith("ConvNeXtBlock") and name == "gamma":
            p.fill_(1e-6)
        else:
            raise RuntimeError(f"no dummy init rule for parameter {name!r} of {kind}")
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        module.weight[module.padding_idx].zero_()


def init_random_weights_(model: nn.Module, seed: int) -> None:
    # One generator on the parameters' device, walked in module order: identical for a (seed, device,
    # dtype) triple, and nothing is drawn on the CPU for a GPU model.
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for module, owner in owned_modules(model):
        _init_module(module, owner, gen)


@torch.no_grad()
def make_code2wav_audible_(code2wav: nn.Module, seed: int) -> None:
    """Redraws a random Code2Wav so it outputs audible audio (~0.1-0.5, clear of the clamp at 1) instead of
    the ~1e-6 that initializer_range 0.02 gives: tiny-checkpoint audio is then audible, and comparisons
    of waveforms are meaningful in absolute terms. Variance-preserving gains; small residual/last gains."""
    gen = torch.Generator(device=next(code2wav.parameters()).device).manual_seed(int(seed))
    for m in code2wav.modules():
        if isinstance(m, nn.Conv1d):  # [out, in / groups, k]
            m.weight.normal_(0, m.weight[0].numel() ** -0.5, generator=gen)
        elif isinstance(m, nn.ConvTranspose1d):  # [in, out, k]: each output sums in * k / stride terms
            m.weight.normal_(0, (m.weight.shape[0] * m.weight.shape[2] / m.stride[0]) ** -0.5, generator=gen)
        elif isinstance(m, nn.Linear):
            m.weight.normal_(0, m.weight.shape[1] ** -0.5, generator=gen)
    for name, p in code2wav.named_parameters():
        if name.endswith(("layer_scale.scale", "gamma")):
            p.fill_(0.5)
        elif name.endswith(("alpha", "beta")):
            p.normal_(0, 0.3, generator=gen)
        elif name.startswith("code_embedding"):
            p.normal_(0, 1.0, generator=gen)
    for name, m in code2wav.decoder.named_modules():
        if name.endswith("conv2"):  # residual units: keep the decoder's activations O(1)
            m.conv.weight.mul_(0.2)
    code2wav.decoder[-1].conv.weight.mul_(0.05)
