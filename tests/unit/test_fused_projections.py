# Merged q/k/v and gate/up projections with their fused epilogues (omnistage/models/fused_projections.py)
# give transformers' results: the kernels alone (run by Triton's CPU interpreter, see tests/conftest.py),
# then whole decoder layers of the talker and the code predictor, and a talker frame through the runner.
import copy

import pytest
import torch

from omnistage.models import experts, fused_ops, fused_projections
from omnistage.models.checkpoint import load_stage

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="triton is not installed")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def on_cpu_too(monkeypatch):
    monkeypatch.setattr(fused_projections, "fused_tensor", lambda t: True)


def talker(dtype=torch.float32, device="cpu"):
    return load_stage("dummy:tiny", "talker", dtype=dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_qk_norm_rope_matches_transformers(device, dtype, cos_batch):
    attn = talker(dtype, device).code_predictor.model.layers[0].self_attn
    g = torch.Generator().manual_seed(cos_batch)
    batch, seq, d = 2, 3, attn.head_dim
    hq, hk = attn.config.num_attention_heads, attn.config.num_key_value_heads
    qkv = torch.randn(batch, seq, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    angles = torch.randn(cos_batch, seq, d, generator=g)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    q, k = qkv[..., : hq * d].view(batch, seq, hq, d), qkv[..., hq * d : (hq + hk) * d].view(batch, seq, hk, d)
    want = fused_ops._original_rope(attn.q_norm.__class__.forward(attn.q_norm, q).transpose(1, 2),
                                    attn.k_norm.__class__.forward(attn.k_norm, k).transpose(1, 2), cos, sin)  # fmt: skip
    got = fused_projections.qk_norm_rope(qkv, hq, hk, attn.q_norm, attn.k_norm, cos, sin)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        if dtype == torch.bfloat16 and device == "cuda":  # rsqrt's last float32 bit, now and then
            torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-6)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_transformers(device, dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 5, 2 * 1100, generator=g) * 3).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = fused_projections.silu_mul(gate_up)
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # exp's last bit may cross a bf16 rounding now and then
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_install_merges_weights_into_views_without_copies():
    model = talker()
    layer = model.code_predictor.model.layers[0]
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    attentions = [m for m in model.modules() if type(m).__name__ in fused_projections.ATTENTION_CLASSES]
    mlps = [m for m in model.modules() if type(m).__name__ in fused_projections.MLP_CLASSES]
    moe = [m for m in model.modules() if experts.is_experts_module(m)]
    assert fused_projections.install(model) == len(attentions) + len(mlps) + len(moe)
    assert attentions and mlps and moe and all(m.fused_epilogues for m in moe)
    attn = layer.self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # views of the merged weight
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_decoder_layers_match_transformers(on_cpu_too, device):
    model = talker(device=device)
    original = copy.deepcopy(model)
    fused_projections.install(model)
    g = torch.Generator().manual_seed(1)
    for stack, ref in ((model.model, original.model), (model.code_predictor.model, original.code_predictor.model)):
        hidden = torch.randn(2, 4, stack.config.hidden_size, generator=g).to(device)
        positions = torch.arange(4, device=device)[None].expand(2, 4)
        if stack is model.model:  # the talker's MRoPE: [3, B, T]
            positions = positions[None].expand(3, 2, 4)
        rope = ref.rotary_emb(hidden, positions)
        for layer, ref_layer in zip(stack.layers, ref.layers):
            got = layer(hidden, attention_mask=None, position_embeddings=rope)
            want = ref_layer(hidden, attention_mask=None, position_embeddings=rope)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lean_experts", [False, True])
def test_thinker_and_talker_with_merged_projections_match_generate(on_cpu_too, hf_model, processor, lean_experts,
                                                                   monkeypatch):  # fmt: skip
    """With lean_experts, the experts run as on cuda: gather_or_grouped (gathered for the one-token steps,
    lean_grouped_mm for the prompts) with its fused silu(gate) * up and its fused way back to the tokens."""
    from .test_stage_oracle import assert_runners_match_generate

    model = copy.deepcopy(hf_model)
    moe = [m for m in model.modules() if experts.is_experts_module(m)]
    combined = []
    if lean_experts:
        experts.register()
        for m in moe:
            m.config._experts_implementation = experts.NAME
        combine = fused_projections.combine_experts
        monkeypatch.setattr(fused_projections, "combine_experts", lambda *a: combined.append(1) or combine(*a))
    assert fused_projections.install(model) > 0 and moe and all(m.fused_epilogues for m in moe)
    assert_runners_match_generate(model, hf_model, processor, thinker_slot=1, talker_slot=2)
    assert bool(combined) == lean_experts  # the lean path ran, with its fused kernels


@pytest.mark.parametrize("stage", ["talker", "code2wav"])
def test_fused_install_gives_each_stage_the_parts_that_apply(stage):
    from omnistage.models import fused

    counts = fused.install(load_stage("dummy:tiny", stage, dtype=torch.float32))
    assert counts["fused_ops"] > 0  # norms everywhere, SnakeBeta in the vocoder
    assert (counts["merged_projections"] > 0) == (stage == "talker")
    assert (counts["copy_free_convs"] > 0) == (stage == "code2wav")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_kind", ["lockstep", "decode_step"])
def test_attention_writes_kv_into_the_cache_as_update_does(on_cpu_too, device, dtype, cache_kind):
    """qkv_into_cache (K normed and rotated, V copied, straight into the cache) leaves the same cache and
    gives the same attention output as the cache's own update() of qk_norm_rope's K and V."""
    from omnistage.stages.kv_cache import LockstepCache
    from omnistage.stages.paged_kv import PagedKVCache

    model = talker(dtype, device)
    fused_projections.install(model)
    stack = model.code_predictor.model if cache_kind == "lockstep" else model.model
    attn = stack.layers[0].self_attn
    cfg = stack.config
    g = torch.Generator().manual_seed(2)
    batch, tokens = (3, 2) if cache_kind == "lockstep" else (3, 1)

    def cache():
        if cache_kind == "lockstep":
            c = LockstepCache(1, batch, cfg.num_key_value_heads, 8, attn.head_dim, dtype, device)
            c.length = 3  # writes at positions 3 and 4
            return c
        paged = PagedKVCache(1, 4, cfg.num_key_value_heads, attn.head_dim, num_blocks=8, max_len=32, dtype=dtype,
                             device=device)  # fmt: skip
        for slot in (2, 0, 1):  # rows' blocks out of order in the pool
            paged.grow(slot, 16)
        paged.sync()
        for t in (paged.k[0], paged.v[0]):
            t.copy_(torch.randn(t.shape, generator=g).to(device, dtype))
        positions = torch.tensor([5, 0, 9], device=device)
        mask = (torch.arange(16, device=device)[None] <= positions[:, None])[:, None, None]
        return paged.step_view(batch, positions, 12, mask)

    hidden = torch.randn(batch, tokens, cfg.hidden_size, generator=g).to(device, dtype)
    positions = torch.arange(3, 3 + tokens, device=device)[None].expand(batch, tokens)
    if cache_kind == "decode_step":  # the talker's MRoPE
        positions = positions[None].expand(3, batch, tokens)
    rope = stack.rotary_emb(hidden, positions)
    fused_cache, plain_cache = cache(), cache()
    if cache_kind == "decode_step":
        plain_cache.cache.k[0].copy_(fused_cache.cache.k[0])
        plain_cache.cache.v[0].copy_(fused_cache.cache.v[0])
    mask = getattr(fused_cache, "mask", None)  # a decode step's rows attend to their own positions
    want, _ = attn(hidden, rope, mask, _UpdateOnly(plain_cache))  # the cache's own update(), gathered
    got, _ = attn(hidden, rope, mask, fused_cache)
    if device == "cuda" and cache_kind == "decode_step":  # the paged decode kernel: its own summation order
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(got, want)
    k_of = (lambda c: c.k[0]) if cache_kind == "lockstep" else (lambda c: c.cache.k[0])
    v_of = (lambda c: c.v[0]) if cache_kind == "lockstep" else (lambda c: c.cache.v[0])
    assert torch.equal(k_of(fused_cache), k_of(plain_cache)) and torch.equal(v_of(fused_cache), v_of(plain_cache))


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),  # Triton's interpreter garbles bf16 dots
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_prefill_after_a_prefix_through_the_paged_kernel_equals_the_gathered_attention(on_cpu_too, monkeypatch,
                                                                                       device, dtype):  # fmt: skip
    """Rows of new tokens after kept prefixes (chunk_prefill.attend_after_prefix), their slots out of order:
    through the paged prefill kernel (as on CUDA) the layer writes K/V into the blocks itself, needs no mask,
    and gives the attention and the cache of the gathered path under its mask."""
    from omnistage.models import paged_attention
    from omnistage.stages.chunk_prefill import attend_after_prefix
    from omnistage.stages.paged_kv import PagedKVCache

    model = talker(dtype, device)
    fused_projections.install(model)
    stack = model.model
    attn = stack.layers[0].self_attn
    cfg = stack.config
    g = torch.Generator().manual_seed(3)
    starts, tokens = [5, 37, 0], 20

    def cache():
        paged = PagedKVCache(1, 4, cfg.num_key_value_heads, attn.head_dim, num_blocks=16, max_len=64, dtype=dtype,
                             device=device)  # fmt: skip
        for slot in (2, 0, 1):  # rows' blocks out of order in the pool
            paged.grow(slot, 64)
        paged.sync()
        for t in (paged.k[0], paged.v[0]):  # the kept prefixes (and what lies past the rows)
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(4)).to(device, dtype))
        return paged

    slots, starts_t = torch.tensor([2, 0, 1], device=device), torch.tensor(starts, device=device)
    hidden = torch.randn(3, tokens, cfg.hidden_size, generator=g).to(device, dtype)
    positions = (starts_t[:, None] + torch.arange(tokens, device=device)[None])[None].expand(3, 3, tokens)
    rope = stack.rotary_emb(hidden, positions)
    runs = {}
    for paged in (False, True):
        monkeypatch.setattr(paged_attention, "serves", lambda _, paged=paged: paged)
        kv = cache()
        mask, writer = attend_after_prefix(kv, slots, starts_t, tokens, 64)
        assert (mask is None) == writer.paged == paged
        runs[paged] = attn(hidden, rope, mask, writer)[0], kv
    (got, got_kv), (want, want_kv) = runs[True], runs[False]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got_kv.k[0], want_kv.k[0]) and torch.equal(got_kv.v[0], want_kv.v[0])


class _UpdateOnly:
    """A cache seen through transformers' update() alone (no kv_target): the attention's unfused way."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, *args, **kwargs):
        return self.cache.update(*args, **kwargs)
