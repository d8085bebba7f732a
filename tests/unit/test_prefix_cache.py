# The thinker's prefix cache on the tiny checkpoint: prompts that share a system prompt get its K/V from the
# pool from the third one on (blocks are kept on their second sighting) and prefill only the rest, with
# generate()'s reply tokens and the same slot K/V and talker conditioning as a full prefill.
import pytest
import torch

from omnistage.core.prefix_index import BLOCK
from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import run_thinker, running, slot_kv

REPLY = 6
LONG_SYSTEM = {"role": "system", "content": "You read the user's message aloud, word for word, and add nothing. " * 3}


def _prompt(processor, text):
    inputs = prepare_inputs(processor, [LONG_SYSTEM, {"role": "user", "content": [{"type": "text", "text": text}]}])
    return inputs, ThinkerPrompt(inputs["input_ids"][0], export_talker=True)


def _runner(hf_model, prefix_bytes):
    return ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=4, max_seq_len=512, device="cpu",
                         dtype=torch.float32, prefix_cache_bytes=prefix_bytes)  # fmt: skip


@torch.inference_mode()
def test_prompts_sharing_a_system_prompt_prefill_only_the_rest_and_match_generate(hf_model, processor):
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    texts = ["Say hello!", "Read this out.", "Good morning to you all.", "Say hello!", "Say hello!"]
    for i, text in enumerate(texts):
        inputs, prompt = _prompt(processor, text)
        want_text, _, _ = oracle.generate(hf_model, inputs, REPLY, 2)
        hits_before = cached.prefix.hit_tokens
        got, _ = run_thinker(cached, running(f"c{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i % 4))
        ref, _ = run_thinker(plain, running(f"p{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i % 4))
        assert got.token_ids == want_text == ref.token_ids
        shared = cached.prefix.hit_tokens - hits_before
        assert (got.cached_tokens, ref.cached_tokens) == (shared, 0)  # each request's own count, for its usage
        # the system prompt's blocks are kept after the second prompt; the 1st prompt's own blocks after its
        # second sighting (the 4th), so the 5th takes all of them but its last token
        assert (shared > 0) == (i >= 2), (i, shared)
        length = prompt.input_ids.numel()
        assert (shared == (length - 1) // BLOCK * BLOCK) == (i == 4), (i, shared, length)
        slot = i % 4
        torch.testing.assert_close(slot_kv(cached.cache, slot, length), slot_kv(plain.cache, slot, length),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(got.text_rows, ref.text_rows)
        torch.testing.assert_close(got.talker.media_rows, ref.talker.media_rows)


@torch.inference_mode()
def test_a_step_of_several_prompts_with_kept_prefixes_pads_like_a_graph_bucket(hf_model, processor):
    """Two cached prompts of different suffix lengths in one step, padded to 4 rows x 32 tokens x 256 kv as a
    CUDA graph would run them, equal each prompt prefilled in full."""
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    warm = [_prompt(processor, t)[1] for t in ("One.", "Two.")]
    for i, prompt in enumerate(warm):  # two sightings: the shared blocks are kept
        run_thinker(cached, running(f"w{i}", SamplingParams(max_tokens=1), prompt, slot=i))
    cached.chunk_prefill.row_buckets = [4]  # graph-style padding, eagerly
    prompts = [_prompt(processor, t)[1] for t in ("Please say hello to everyone here.", "Hi.")]
    seqs = [running(f"s{i}", SamplingParams(max_tokens=REPLY), p, slot=2 * i + 1) for i, p in enumerate(prompts)]
    hits_before = cached.prefix.hit_tokens
    got = cached.prefill(seqs)
    assert cached.prefix.hit_tokens > hits_before
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        ref = plain.prefill([running(f"r{i}", SamplingParams(max_tokens=REPLY), prompt, slot=seq.slot)])[0]
        assert got[i].output.token_ids == ref.output.token_ids
        n = prompt.input_ids.numel()
        torch.testing.assert_close(slot_kv(cached.cache, seq.slot, n), slot_kv(plain.cache, seq.slot, n),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_a_zero_budget_keeps_nothing(hf_model):
    runner = _runner(hf_model, 0)
    assert runner.prefix is None and runner.stats()["prefix_hit_tokens"] == runner.stats()["prefix_prompt_tokens"] == 0


@pytest.mark.gpu
@torch.inference_mode()
def test_chunk_prefill_graphs_equal_the_full_prefill_on_cuda(tiny_checkpoint, processor):
    """As served on CUDA (bf16, gather_or_grouped experts, graphs): a prompt whose system prompt comes from the pool
    leaves the K/V of a full prefill in its slot, within bf16 rounding."""
    from omnistage.models.checkpoint import load_config, load_stage

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    kw = dict(max_slots=4, max_seq_len=512, device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    cached = ThinkerRunner(model, config, prefix_cache_bytes=8 << 20, **kw)
    plain = ThinkerRunner(model, config, **kw)
    cached.capture_graphs()
    plain.capture_graphs()
    for i, text in enumerate(["One.", "Two.", "Say hello!"]):
        prompt = _prompt(processor, text)[1]
        cached.prefill([running(f"c{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i)])
        plain.prefill([running(f"p{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i)])
    assert cached.prefix.hit_tokens > 0  # the third took the system prompt from the pool
    n = prompt.input_ids.numel()
    torch.testing.assert_close(slot_kv(cached.cache, 2, n), slot_kv(plain.cache, 2, n), rtol=0.05, atol=0.05)


def test_chunk_prefill_buckets_keep_every_padded_position_below_its_kv_length(hf_model):
    """With graphs' buckets (set by hand on the CPU): a step's padded tokens all land below its kv bucket,
    and a suffix that would not fit any bucket goes to the full prefill instead (fits() is False)."""
    runner = _runner(hf_model, 8 << 20)
    chunk = runner.chunk_prefill
    chunk.row_buckets = [1, 2, 4]
    assert chunk.shape_for(3, 20, 200) == (4, 32, 256)
    assert chunk.shape_for(1, 40, 200) == (1, 48, 256)
    assert chunk.shape_for(1, 50, 200) == (1, 64, 512)  # 200 + 64 padded tokens need the 512 bucket
    assert chunk.fits(4, 64, 448) and not chunk.fits(4, 64, 449)  # 449 + 64 > 512
    assert not chunk.fits(4, 65, 0) and not chunk.fits(5, 10, 0)  # too long a suffix, too many rows
