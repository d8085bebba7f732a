# Long text prompts and the thinker's prefix cache, on the tiny checkpoint, through a StageEngine whose
# scheduler admits by blocks:
# - each turn of a long chat takes the blocks its earlier turns left in the pool and prefills only the rest,
#   in chunks starting right after them, and still gets generate()'s tokens on the whole prompt;
# - a burst of unrelated long prompts keeps its blocks on probation, so a shared short prefix stays kept;
# - blocks go back to the pool when sequences end and the cache lets go of them.
import pytest
import torch

from omnistage.core.block_pool import BLOCK
from omnistage.core.engine import StageEngine
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Scheduler, Sequence
from omnistage.models.processor import prepare_inputs
from omnistage.stages.long_prefill import CHUNK_TOKENS
from omnistage.stages.paged_kv import block_bytes
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_chunked_prefill import Outputs, Steps
from .test_prefix_cache import _prompt
from .test_stage_oracle import running, slot_kv

REPLY = 4


def words(n, k):
    return " ".join(f"word{(i * k) % 89} and" for i in range(n))


def user(text):
    return {"role": "user", "content": [{"type": "text", "text": text}]}


class Served:
    """A ThinkerRunner with a prefix cache of `kept` blocks behind a StageEngine that schedules by blocks,
    with a one-chunk prefill budget per step (so a long prompt's rest goes in several pieces)."""

    def __init__(self, hf_model, kept):
        config = hf_model.config
        unit = block_bytes(config.thinker_config.text_config, torch.float32)
        self.runner = ThinkerRunner(hf_model.thinker, config, max_slots=4, max_seq_len=2048, device="cpu",
                                    dtype=torch.float32, prefix_cache_bytes=kept * unit)  # fmt: skip
        self.steps, self.out = Steps(self.runner), Outputs()
        scheduler = Scheduler(4, 4, max_prefill_tokens=CHUNK_TOKENS, blocks=self.runner.cache.pool)
        self.engine = StageEngine("thinker", self.runner, scheduler, self.out)
        self.engine.start()

    def __call__(self, *prompts):
        """Serves the prompts (token ids) together; returns each one's prompt tokens taken from the pool."""
        hits, ids = self.runner.prefix.hit_tokens, []
        for prompt in prompts:
            ids.append(f"r{len(self.out.got) + len(ids)}")
            self.engine.add(Sequence(ids[-1], SamplingParams(max_tokens=REPLY, ignore_eos=True), ThinkerPrompt(prompt)))
        self.out.wait(*ids)
        return self.runner.prefix.hit_tokens - hits, [self.out.got[i].token_ids for i in ids], ids

    def close(self):
        self.engine.stop()


def test_each_turn_of_a_long_chat_prefills_only_what_follows_its_earlier_turns(hf_model, processor):
    chat = [oracle.SYSTEM, user(words(150, 3))]
    served = Served(hf_model, kept=256)
    try:
        previous = 0
        for turn in range(3):
            inputs = prepare_inputs(processor, chat)
            n = inputs["input_ids"].shape[1]
            assert n > CHUNK_TOKENS
            hit, [tokens], [rid] = served(inputs["input_ids"][0])
            assert tokens == oracle.generate(hf_model, inputs, REPLY, 2)[0]
            # the earlier turn's prompt is a prefix of this one: all its full blocks come from the pool, and
            # this prompt's pieces start right after them
            assert hit == (previous - 1) // BLOCK * BLOCK if turn else hit == 0, (turn, hit, previous)
            pieces = served.steps.pieces(rid)
            assert pieces[0][0] == hit and pieces[-1][1] == n and len(pieces) == -(-(n - hit) // CHUNK_TOKENS)
            chat += [{"role": "assistant", "content": f"Sure, turn {turn} it is."}, user(words(60, 5 + turn))]
            previous = n
        assert served.runner.stats()["prefix_hit_tokens"] > 0
    finally:
        served.close()


def test_a_burst_of_unrelated_long_prompts_leaves_a_shared_short_prefix_kept(hf_model, processor):
    served = Served(hf_model, kept=64)  # 48 protected at most; each long prompt has ~38 blocks
    pool = served.runner.cache.pool
    try:
        short = [_prompt(processor, t)[1].input_ids for t in ("One.", "Two.", "Three.")]
        served(short[0])
        served(short[1])  # the system prompt's blocks, seen twice, are kept
        system = len(served.runner.prefix.index)
        assert system > 0
        burst = [prepare_inputs(processor, [oracle.SYSTEM, user(words(150, k))])["input_ids"][0]
                 for k in (7, 11, 13, 17)]  # fmt: skip
        served(*burst[:2])
        served(*burst[2:])
        assert len(served.runner.prefix.index) == 64  # the burst's blocks fill the cache's budget
        hit, _, _ = served(short[2])
        assert hit == system * BLOCK  # and did not push the shared prefix out
        # nothing runs: only the cache holds blocks, each alone; once it lets go, the pool is empty
        kept = served.runner.prefix.index.blocks()
        assert pool.used_blocks == len(kept) and all(pool.refs[b] == 1 for b in kept)
        served.runner.prefix.reclaim(len(kept))
        assert pool.used_blocks == 0 and len(served.runner.prefix.index) == 0
    finally:
        served.close()


def _next_turn(runner, first, second, slot):
    """Prefills `first` whole (its blocks are kept), then `second` in one piece after the kept prefix it finds,
    as the scheduler hands it over. Returns the second's prefill result and its kept prefix's length."""
    runner.prefill([running("first", SamplingParams(max_tokens=1), ThinkerPrompt(first), slot=slot)])
    runner.release(Sequence("first", SamplingParams(), None, slot=slot))
    seq = running("second", SamplingParams(max_tokens=REPLY), ThinkerPrompt(second), slot=slot)
    seq.prefix = runner.prefix_blocks(seq)
    seq.prompt_len = seq.prefilled = second.numel()
    seq.chunk = seq.prompt_len - seq.cached
    [result] = runner.prefill([seq])
    return result, seq.cached


@torch.inference_mode()
def test_rows_after_a_kept_prefix_padded_like_graph_buckets_equal_a_full_prefill(hf_model, processor):
    """With graphs' buckets (set by hand on the CPU): the rows after a kept prefix start off the chunk grid
    and are padded to CHUNK_TOKENS; the slot ends with the K/V of the prompt prefilled whole."""
    first = prepare_inputs(processor, [oracle.SYSTEM, user(words(150, 3))])["input_ids"][0]
    second = torch.cat([first, first[:300]])
    runner = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=2, max_seq_len=2048, device="cpu",
                           dtype=torch.float32, prefix_cache_bytes=8 << 20)  # fmt: skip
    runner.long_prefill.rows.row_buckets = [1, 2, 4]
    plain = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=2, max_seq_len=2048, device="cpu",
                          dtype=torch.float32)  # fmt: skip
    result, cached = _next_turn(runner, first, second, slot=1)
    assert cached == (first.numel() - 1) // BLOCK * BLOCK and cached % CHUNK_TOKENS
    [whole] = plain.prefill([running("whole", SamplingParams(max_tokens=REPLY), ThinkerPrompt(second), slot=1)])
    assert result.output.token_ids == whole.output.token_ids
    n = second.numel()
    torch.testing.assert_close(slot_kv(runner.cache, 1, n), slot_kv(plain.cache, 1, n), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@torch.inference_mode()
def test_rows_after_a_kept_prefix_replayed_as_graphs_equal_an_eager_prefill_on_cuda(tiny_checkpoint, processor):
    """As served on CUDA (bf16, graphs): the next turn's rows after its kept prefix leave the K/V of the
    prompt prefilled whole without graphs in its slot and its logits, within bf16 rounding."""
    from omnistage.models.checkpoint import load_config, load_stage

    from .test_chunked_prefill import assert_close_in_bf16, assert_same_pick_in_bf16, recording_logits

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    kw = dict(max_slots=2, max_seq_len=2000, device="cuda", dtype=torch.bfloat16)
    graphs = recording_logits(ThinkerRunner(model, config, cuda_graphs=True, prefix_cache_bytes=8 << 20, **kw))
    eager = recording_logits(ThinkerRunner(model, config, **kw))
    graphs.capture_graphs()
    first = prepare_inputs(processor, [oracle.SYSTEM, user(words(150, 3))])["input_ids"][0]
    second = torch.cat([first, first[:300]])
    result, cached = _next_turn(graphs, first, second, slot=1)
    assert cached % CHUNK_TOKENS
    [whole] = eager.prefill([running("whole", SamplingParams(max_tokens=REPLY), ThinkerPrompt(second), slot=1)])
    assert_same_pick_in_bf16(graphs, eager, result, whole)
    n = second.numel()
    assert_close_in_bf16(slot_kv(graphs.cache, 1, n), slot_kv(eager.cache, 1, n))
