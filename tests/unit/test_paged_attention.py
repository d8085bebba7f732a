# Attention through block tables: the paged decode kernel (models/paged_attention.py, run by Triton's CPU
# interpreter here, see tests/conftest.py) against the gathered reference (stages/paged_kv.py: a row's
# blocks gathered, SDPA under the mask), and that reference against dense attention over each row's own
# contiguous K/V, with rows of very different lengths in one batch and blocks scattered over the pool.
import pytest
import torch
import torch.nn.functional as F

from omnistage.core.block_pool import BLOCK
from omnistage.models import fused_ops, paged_attention
from omnistage.stages.paged_kv import PagedKVCache

HEADS, KV_HEADS, DIM = 8, 2, 32


def scattered_cache(lengths: list[int], seed: int = 0) -> tuple[PagedKVCache, list[torch.Tensor], list[torch.Tensor]]:
    """A one-layer cache holding random K/V for each row (slot r) up to its length, its blocks interleaved
    with the other rows' (grown a block at a time, round robin); returns it and each row's dense K, V."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, len(lengths), KV_HEADS, DIM, num_blocks=64, max_len=512, dtype=torch.float32, device="cpu")
    for step in range(1, max(lengths) // BLOCK + 2):
        for slot, n in enumerate(lengths):
            cache.grow(slot, min(n, step * BLOCK))
    cache.sync()
    ks, vs = [], []
    for slot, n in enumerate(lengths):
        k, v = torch.randn(1, KV_HEADS, n, DIM, generator=g), torch.randn(1, KV_HEADS, n, DIM, generator=g)
        cache.write(0, cache.physical(torch.tensor([slot]), torch.arange(n)[None]), k, v)
        ks.append(k)
        vs.append(v)
    return cache, ks, vs


def dense(query: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Each row's attention over its own contiguous K/V: [B, 1, H, D]."""
    out = [F.scaled_dot_product_attention(q[None], k, v, scale=DIM**-0.5, enable_gqa=True)
           for q, k, v in zip(query, ks, vs)]  # fmt: skip
    return torch.cat(out).transpose(1, 2)


LENGTHS = [1, 17, 300, 40, 16, 63]


def test_gathered_blocks_under_the_mask_equal_dense_attention():
    cache, ks, vs = scattered_cache(LENGTHS)
    assert cache.pool.tables[2][:3] != [cache.pool.tables[2][0] + i for i in range(3)]  # really scattered
    query = torch.randn(len(LENGTHS), HEADS, 1, DIM)
    rows = torch.arange(len(LENGTHS))
    k, v = cache.gather(0, rows, -(-max(LENGTHS) // BLOCK))
    mask = (torch.arange(k.shape[2])[None] < torch.tensor(LENGTHS)[:, None])[:, None, None]
    got = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=DIM**-0.5, enable_gqa=True)
    torch.testing.assert_close(got.transpose(1, 2), dense(query, ks, vs))


@pytest.mark.skipif(not fused_ops.available(), reason="needs triton")
@pytest.mark.parametrize("min_part", [paged_attention.TILE, paged_attention.MIN_PART])
def test_paged_decode_kernel_equals_dense_attention_per_row(monkeypatch, min_part):
    # a 300-position row in parts of at least min_part positions: 5 or 2 parts, merged; the short rows in one
    monkeypatch.setattr(paged_attention, "MIN_PART", min_part)
    cache, ks, vs = scattered_cache(LENGTHS, seed=1)
    query = torch.randn(len(LENGTHS), HEADS, 1, DIM)
    got = paged_attention.decode(query, cache.k[0], cache.v[0], cache.table, torch.tensor(LENGTHS), DIM**-0.5)
    torch.testing.assert_close(got, dense(query, ks, vs), rtol=1e-4, atol=1e-5)


def causal_dense(query: torch.Tensor, starts: list[int], news: list[int], ks: list[torch.Tensor],
                 vs: list[torch.Tensor], dim: int = DIM) -> list[torch.Tensor]:
    """Row r's first news[r] queries, at positions starts[r].., each over its own contiguous K/V up to its own
    position: [news[r], H, D] per row."""
    out = []
    for q, start, n, k, v in zip(query, starts, news, ks, vs):
        length = start + n
        mask = torch.arange(length)[None] <= (start + torch.arange(n))[:, None]  # [n, length]
        o = F.scaled_dot_product_attention(q[None, :, :n], k[:, :, :length], v[:, :, :length], attn_mask=mask,
                                           scale=dim**-0.5, enable_gqa=True)  # fmt: skip
        out.append(o[0].transpose(0, 1))
    return out


@pytest.mark.skipif(not fused_ops.available(), reason="needs triton")
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_paged_prefill_kernel_equals_causal_dense_attention_per_row(parts):
    # rows of 20 new tokens (the last 7 of one row are padding) after kept prefixes of very different
    # lengths, their blocks scattered: two query tiles a row, several KV tiles for the long prefix. Split
    # into parts, some parts see none of a row's positions, and some of a tile's queries none of a part's
    # (the row at 50: its first tile's queries before position 64 see nothing of the part from 64)
    starts, news, tokens = [0, 16, 283, 50], [20, 20, 13, 20], 20
    cache, ks, vs = scattered_cache([s + n for s, n in zip(starts, news)], seed=2)
    query = torch.randn(len(starts), HEADS, tokens, DIM)
    slots = torch.arange(len(starts))
    got = paged_attention.prefill(query, cache.k[0], cache.v[0], cache.table, slots, torch.tensor(starts), DIM**-0.5,
                                  parts=parts)  # fmt: skip
    assert got.shape == (len(starts), tokens, HEADS, DIM)
    for r, want in enumerate(causal_dense(query, starts, news, ks, vs)):
        torch.testing.assert_close(got[r, : news[r]], want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not fused_ops.available(), reason="needs triton")
@pytest.mark.parametrize("parts", [1, 4])
def test_paged_prefill_kernel_reads_each_rows_own_slot(parts):
    # rows in another order than their slots, one slot twice (two pieces of one prompt in one forward)
    cache, ks, vs = scattered_cache([48, 16, 66], seed=3)
    order = [2, 0, 0]
    row_starts = [50, 16, 32]
    query = torch.randn(3, HEADS, 16, DIM)
    got = paged_attention.prefill(query, cache.k[0], cache.v[0], cache.table, torch.tensor(order),
                                  torch.tensor(row_starts), DIM**-0.5, parts=parts)  # fmt: skip
    wants = causal_dense(query, row_starts, [16, 16, 16], [ks[o] for o in order], [vs[o] for o in order])
    for r, want in enumerate(wants):
        torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(32, 4), (16, 2)])  # the thinker's and the talker's
def test_paged_decode_kernel_on_cuda_equals_gathered_attention(heads, kv_heads):
    """Compiled, bf16, real head geometry: 64 rows of W1-like lengths beside a 30,000-token row."""
    lengths = [150 + 7 * i for i in range(63)] + [30000]
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = PagedKVCache(1, len(lengths), kv_heads, 128, num_blocks=4096, max_len=32768, dtype=torch.bfloat16,
                         device="cuda")  # fmt: skip
    for slot, n in enumerate(lengths):
        cache.grow(slot, n)
    cache.sync()
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g, device="cuda"))
    query = torch.randn(len(lengths), heads, 1, 128, generator=g, device="cuda").to(torch.bfloat16)
    lengths_t = torch.tensor(lengths, device="cuda")
    got = paged_attention.decode(query, cache.k[0], cache.v[0], cache.table, lengths_t, 128**-0.5)
    rows = torch.arange(len(lengths), device="cuda")
    for part in (rows[:63], rows[63:]):  # gathered to each part's longest row, masked per row
        n = max(lengths[int(part[-1])], lengths[int(part[0])])
        k, v = cache.gather(0, part, -(-n // BLOCK))
        mask = (torch.arange(k.shape[2], device="cuda")[None] < lengths_t[part][:, None])[:, None, None]
        want = F.scaled_dot_product_attention(query[part], k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True)
        torch.testing.assert_close(got[part], want.transpose(1, 2), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(32, 4), (16, 2)])  # the thinker's and the talker's
@pytest.mark.parametrize("starts", [[0, 700, 29000], [29000]])  # the lone piece's grid is split into parts
def test_paged_prefill_kernel_on_cuda_equals_gathered_attention(heads, kv_heads, starts):
    """Compiled, bf16, real head geometry: 512-token rows of long prompts' pieces, one at the start of its
    prompt, one after 700 positions, one after 29,000, each over its own slot; and a piece after 29,000
    alone, whose 128 or 64 programs prefill_parts() splits."""
    tokens = 512
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = PagedKVCache(1, len(starts), kv_heads, 128, num_blocks=2048, max_len=32768, dtype=torch.bfloat16,
                         device="cuda")  # fmt: skip
    for slot, start in enumerate(starts):
        cache.grow(slot, start + tokens)
    cache.sync()
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g, device="cuda"))
    query = torch.randn(len(starts), heads, tokens, 128, generator=g, device="cuda").to(torch.bfloat16)
    slots, starts_t = torch.arange(len(starts), device="cuda"), torch.tensor(starts, device="cuda")
    got = paged_attention.prefill(query, cache.k[0], cache.v[0], cache.table, slots, starts_t, 128**-0.5)
    for r, start in enumerate(starts):
        k, v = cache.gather(0, slots[r : r + 1], -(-(start + tokens) // BLOCK))
        positions = start + torch.arange(tokens, device="cuda")
        mask = (torch.arange(k.shape[2], device="cuda")[None] <= positions[:, None])[None, None]
        want = F.scaled_dot_product_attention(query[r : r + 1], k, v, attn_mask=mask, scale=128**-0.5,
                                              enable_gqa=True)  # fmt: skip
        torch.testing.assert_close(got[r], want[0].transpose(0, 1), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@torch.inference_mode()
def test_decode_graphs_over_the_paged_kernel_equal_eager_steps_on_cuda(tiny_checkpoint, processor):
    """As served on CUDA (bf16, fused kernels, graphs per rows bucket): two prompts of different lengths
    decoded side by side give the tokens of the same steps run eagerly."""
    from omnistage.core.sampling import SamplingParams
    from omnistage.models.checkpoint import load_config, load_stage
    from omnistage.models.processor import prepare_inputs
    from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

    from .. import oracle
    from .test_stage_oracle import running

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    texts = ["Say hello!", "Tell me a long story about the sea, please, in three short sentences."]
    prompts = [ThinkerPrompt(prepare_inputs(processor, oracle.messages("text", t))["input_ids"][0]) for t in texts]
    tokens = {}
    for graphs in (False, True):
        runner = ThinkerRunner(model, config, max_slots=4, max_seq_len=512, device="cuda", dtype=torch.bfloat16,
                               cuda_graphs=graphs)  # fmt: skip
        runner.capture_graphs()
        seqs = [running(f"s{i}", SamplingParams(max_tokens=24), p, slot=i) for i, p in enumerate(prompts)]
        results, out = runner.prefill(seqs), [[], []]
        while all(r.finish_reason is None for r in results):
            for i, r in enumerate(results):
                out[i] += r.output.token_ids
            results = runner.decode(seqs)
        tokens[graphs] = out
    assert tokens[True] == tokens[False] and all(len(t) > 16 for t in tokens[True])


def test_prefill_parts_fill_the_gpu_only_where_the_grid_does_not(monkeypatch):
    monkeypatch.setattr(paged_attention, "_sms", lambda device: 132)  # an H100's or H200's SMs
    assert paged_attention.prefill_parts(3 * 4 * 32, "cuda") == 1  # three 512-token rows: 384 programs
    assert paged_attention.prefill_parts(1 * 4 * 32, "cuda") == 3  # a lone 512-token piece of the thinker
    assert paged_attention.prefill_parts(1 * 2 * 8, "cuda") == paged_attention.PREFILL_PARTS  # capped
