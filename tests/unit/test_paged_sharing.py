# The thinker's paged KV cache under memory pressure and with shared prefixes, on the tiny checkpoint:
# - a pool too small for its running sequences' replies makes the scheduler preempt the newest, which is
#   recomputed from its prompt and the tokens it had generated when it comes back: every sequence still gets
#   generate()'s tokens, and the pool is empty once they are done;
# - sequences that start with a kept prefix hold the prefix cache's very blocks (one more holder each, no
#   copy) while they run side by side, and get generate()'s tokens.
import torch

from omnistage.core.block_pool import BLOCK, blocks_for
from omnistage.core.engine import StageEngine
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Scheduler, Sequence
from omnistage.models.processor import prepare_inputs
from omnistage.stages.kv_budget import kv_bytes_per_token
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_engine import Collector
from .test_prefix_cache import _prompt
from .test_stage_oracle import run_thinker, running

REPLY = 20  # more than a block: every sequence needs blocks beyond its prompt's


def test_preempted_sequences_resume_with_generates_tokens(hf_model, processor):
    texts = ["Say hello!", "Tell me about the sea, in one short sentence.", "Count to three."]
    inputs = [prepare_inputs(processor, oracle.messages("text", t)) for t in texts]
    lengths = [x["input_ids"].shape[1] for x in inputs]
    max_len = max(lengths) + REPLY + 1
    # room for every prompt and its first decode position, not for their replies
    blocks = max(sum(blocks_for(n + 1) for n in lengths), blocks_for(max_len + 1))
    text = hf_model.config.thinker_config.text_config
    budget = blocks * BLOCK * kv_bytes_per_token(text, torch.float32)
    runner = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=4, max_seq_len=max_len, device="cpu",
                           dtype=torch.float32, kv_cache_bytes=budget)  # fmt: skip
    scheduler = Scheduler(4, 8, blocks=runner.cache.pool, reply_reserve=0)
    collector = Collector()
    engine = StageEngine("thinker", runner, scheduler, collector)
    engine.start()
    try:
        for i, x in enumerate(inputs):
            engine.add(Sequence(f"r{i}", SamplingParams(max_tokens=REPLY), ThinkerPrompt(x["input_ids"][0])))
        collector.wait(*[f"r{i}" for i in range(len(inputs))], timeout=300)
    finally:
        engine.stop()
    assert scheduler.preemptions > 0
    for i, x in enumerate(inputs):
        assert collector.done[f"r{i}"] == "length"
        got = [t for out in collector.outputs(f"r{i}") for t in out.token_ids]
        assert got == oracle.generate(hf_model, x, REPLY, 2)[0], i
    assert runner.cache.pool.used_blocks == 0 and engine.stats()["preemptions"] == scheduler.preemptions


@torch.inference_mode()
def test_sequences_with_a_kept_prefix_hold_its_blocks_side_by_side(hf_model, processor):
    runner = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=4, max_seq_len=512, device="cpu",
                           dtype=torch.float32, prefix_cache_bytes=8 << 20)  # fmt: skip
    for i, text in enumerate(["One.", "Two."]):  # two sightings: the system prompt's blocks are kept
        seq = running(f"w{i}", SamplingParams(max_tokens=1), _prompt(processor, text)[1], slot=i)
        run_thinker(runner, seq)
        runner.release(seq)
    kept = set(runner.prefix.index.blocks())
    assert kept and runner.cache.pool.used_blocks == len(kept)  # the warm-ups' own blocks went back
    texts = ["Please say hello to everyone here.", "Hi."]
    seqs = [running(f"s{i}", SamplingParams(max_tokens=REPLY), _prompt(processor, t)[1], slot=2 + i)
            for i, t in enumerate(texts)]  # fmt: skip
    results = runner.prefill(seqs)
    tables = runner.cache.pool.tables
    shared = [b for b, c in zip(tables[2], tables[3]) if b == c]
    assert shared and set(shared) <= kept and all(runner.cache.pool.refs[b] == 3 for b in shared)
    assert not set(tables[2][len(shared) :]) & set(tables[3][len(shared) :])  # past the prefix: their own
    outs = {r.seq.request_id: r.output for r in results}
    while all(r.finish_reason is None for r in results):
        results = runner.decode(seqs)
        for r in results:
            outs[r.seq.request_id] = outs[r.seq.request_id].merge(r.output)
    for i, text in enumerate(texts):
        assert outs[f"s{i}"].token_ids == oracle.generate(hf_model, _prompt(processor, text)[0], REPLY, 2)[0]
    for seq in seqs:
        runner.release(seq)
    assert runner.cache.pool.used_blocks == len(kept) and all(runner.cache.pool.refs[b] == 1 for b in shared)
