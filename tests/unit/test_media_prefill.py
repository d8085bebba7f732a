# The thinker's media prefill (stages/media_prefill.py): audio and image prompts prefilled together, padded to
# a (rows, tokens) bucket, leave in each slot the K/V and return the last hidden state and accept-layer rows
# that each prompt gets when prefilled alone, and touch no other slot; on CUDA, replayed graphs give what the
# eager run gives.
import pytest
import torch

from omnistage.core.block_pool import BLOCK
from omnistage.models.processor import prepare_inputs
from omnistage.stages.cuda_graphs import batch_buckets
from omnistage.stages.media_prefill import MediaPrefill
from omnistage.stages.media_rows import MediaInputs
from omnistage.stages.paged_kv import PagedKVCache
from omnistage.stages.static_prefill import token_buckets
from omnistage.stages.thinker import ThinkerPrompt

from .. import oracle
from .test_stage_oracle import slot_kv


def _prompts(processor) -> list[ThinkerPrompt]:
    out = []
    for kind in ("audio", "image"):
        x = prepare_inputs(processor, oracle.messages(kind))
        out.append(ThinkerPrompt(x["input_ids"][0], x.get("pixel_values"), x.get("image_grid_thw"),
                                 x.get("input_features"), x.get("feature_attention_mask")))  # fmt: skip
    return out


def _prefill(thinker, prompts, slots, device="cpu", dtype=torch.float32, buckets=None, cuda_graphs=False):
    cfg = thinker.config.text_config
    cache = PagedKVCache(cfg.num_hidden_layers, 6, cfg.num_key_value_heads, cfg.head_dim, num_blocks=64, max_len=256,
                         dtype=dtype, device=device)  # fmt: skip
    cache.k_all.fill_(7.0)  # what was there before
    cache.v_all.fill_(7.0)
    deepstack = len(thinker.config.vision_config.deepstack_visual_indexes)
    prefill = MediaPrefill("test", thinker.model, cache, max_rows=4, max_tokens=128, deepstack=deepstack,
                           accept_layer=3, cuda_graphs=cuda_graphs)  # fmt: skip
    if buckets:
        prefill.row_buckets, prefill.token_buckets = buckets
    prefill.capture_all()
    rows = MediaInputs(thinker).rows(prompts, [0] * len(prompts))
    hidden = prefill.run(rows, slots, [0] * len(prompts))
    accept = [prefill.accept_out[i, : p.input_ids.numel()].clone() for i, p in enumerate(prompts)]
    return hidden.clone(), [r.rope_delta for r in rows], accept, cache


@torch.inference_mode()
def test_media_prompts_padded_together_equal_each_prompt_alone(hf_model, processor):
    prompts = _prompts(processor)
    hidden, deltas, accept, cache = _prefill(hf_model.thinker, prompts, [4, 1], buckets=([4], [64, 128]))
    for i, (prompt, slot) in enumerate(zip(prompts, [4, 1])):
        h, d, a, own = _prefill(hf_model.thinker, [prompt], [slot])
        n = prompt.input_ids.numel()
        assert deltas[i] == d[0]
        assert oracle.rel_error(hidden[i], h[0]) < 1e-5
        assert oracle.rel_error(accept[i], a[0]) < 1e-5
        assert oracle.rel_error(slot_kv(cache, slot, n), slot_kv(own, slot, n)) < 1e-5
    held = max(b for table in cache.pool.tables for b in table)
    assert all(bool((k[:, (held + 1) * BLOCK :] == 7.0).all()) for k in (cache.k_all, cache.v_all))  # no other block


@pytest.mark.gpu
@torch.inference_mode()
def test_media_prefill_graphs_equal_eager_on_cuda(hf_model, processor):
    import copy

    from omnistage.models import fused

    thinker = copy.deepcopy(hf_model.thinker).to("cuda", torch.bfloat16)
    fused.install(thinker)  # as a CUDA runner serves: its paged prefill attends in the fused attention
    prompts = _prompts(processor)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    # the eager run at the graphs' bucket shapes: the same kernels on the same shapes
    eager = _prefill(thinker, prompts, [4, 1], buckets=(batch_buckets(4), token_buckets(128)), **kw)
    graphed = _prefill(thinker, prompts, [4, 1], cuda_graphs=True, **kw)
    assert torch.equal(eager[0], graphed[0]) and eager[1] == graphed[1]
    assert all(torch.equal(a, b) for a, b in zip(eager[2], graphed[2]))


def test_placeholder_counts_that_differ_from_the_media_are_refused(hf_model, processor):
    from dataclasses import replace

    from omnistage.core.errors import BadRequestError

    prefill = MediaInputs(hf_model.thinker)
    for prompt in _prompts(processor):
        prefill.validate(prompt)  # as the processor makes them
        placeholder = hf_model.config.thinker_config.audio_token_id if prompt.input_features is not None else \
            hf_model.config.thinker_config.image_token_id  # fmt: skip
        extra = replace(prompt, input_ids=torch.cat([prompt.input_ids, torch.tensor([placeholder])]))
        with pytest.raises(BadRequestError, match="placeholder"):
            prefill.validate(extra)
