# Chunked prefill on the tiny checkpoint: a prompt longer than the static prefill takes whole is prefilled in
# pieces over engine steps, interleaved with the decode steps of running streams, and its reply equals
# transformers' generate() on the whole prompt, for the thinker and the talker alike.
import threading

import types

import pytest
import torch

from omnistage.core.engine import StageEngine
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Scheduler, Sequence
from omnistage.models.processor import prepare_inputs
from omnistage.stages.long_prefill import CHUNK_TOKENS, PIECE_TOKENS
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import slot_kv

REPLY, FRAMES = 6, 10
RUNNER = dict(max_slots=4, max_seq_len=2048, device="cpu", dtype=torch.float32)


class Steps:
    """Wraps a runner's prefill and decode: the log of steps, as (phase, {request id: piece or None}), and
    each prompt's K/V as its slot holds them right after its last piece (kv: request id -> (keys, values))."""

    def __init__(self, runner):
        self.log, self.kv = [], {}
        for phase in ("prefill", "decode"):
            run = getattr(runner, phase)
            setattr(runner, phase, self._logged(phase, run, runner))

    def _logged(self, phase, run, runner):
        def step(seqs, *riders):  # decode's riders: pieces in its forward, logged as a prefill before it
            prefills = seqs if phase == "prefill" else [s for r in riders for s in r]
            lengths = {s.request_id: runner.prompt_tokens(s) for s in prefills}
            pieces = {s.request_id: s.piece(lengths[s.request_id]) for s in prefills}
            if prefills:
                self.log.append(("prefill", pieces))
            if phase == "decode":
                self.log.append(("decode", {s.request_id: None for s in seqs}))
            results = run(seqs, *riders)
            for s in prefills:
                if pieces[s.request_id][1] == lengths[s.request_id]:
                    self.kv[s.request_id] = runner.cache.read(s.slot, lengths[s.request_id])
            return results

        return step

    def pieces(self, request_id):
        return [p[request_id] for phase, p in self.log if phase == "prefill" and request_id in p]

    def decodes_between_pieces(self, long_id, short_id):
        """For each gap between two prefill pieces of long_id: the decode steps short_id took in it."""
        marks = [i for i, (phase, p) in enumerate(self.log) if phase == "prefill" and long_id in p]
        return [sum(1 for phase, p in self.log[a:b] if phase == "decode" and short_id in p)
                for a, b in zip(marks, marks[1:])]  # fmt: skip


class Outputs:
    def __init__(self):
        self.got, self.ended, self.cv = {}, {}, threading.Condition()

    def __call__(self, request_id, output, finish_reason, error):
        with self.cv:
            if output is not None:
                self.got[request_id] = self.got[request_id].merge(output) if request_id in self.got else output
            if finish_reason or error:
                self.ended[request_id] = finish_reason or error
            self.cv.notify_all()

    def wait(self, *ids, timeout=300):
        with self.cv:
            assert self.cv.wait_for(lambda: all(i in self.ended for i in ids), timeout), self.ended
        assert all(self.ended[i] == "length" for i in ids), self.ended


def decode_forwards(runner) -> list[tuple[list[str], list[int]]]:
    """Wraps the runner's decode; returns the log of its calls: per call, its riders' request ids and the
    tokens of each call of the first layer's MLP in it (one call: the decode rows and the riders went
    through one forward, which reads the experts once)."""
    mlp, calls, steps = runner.model.model.layers[0].mlp, [], []
    forward, decode = mlp.forward, runner.decode
    mlp.forward = lambda x: calls.append(x.numel() // x.shape[-1]) or forward(x)

    def logged(seqs, *riders):
        calls.clear()
        out = decode(seqs, *riders)
        steps.append(([s.request_id for r in riders for s in r], list(calls)))
        return out

    runner.decode = logged
    return steps


def serve(runner, budget, requests, later=(), **scheduler):
    """Runs (request id, params, payload) through a StageEngine over `runner` with a per-step prefill budget
    of `budget` tokens (and the Scheduler's other arguments); every request added before the loop starts,
    those of `later` once the first request's first output is out. Returns the outputs and the step log."""
    steps, out = Steps(runner), Outputs()
    engine = StageEngine("test", runner, Scheduler(4, max_prefills_per_step=4, max_prefill_tokens=budget, **scheduler),
                         out)  # fmt: skip
    for request_id, params, payload in requests:
        engine.add(Sequence(request_id, params, payload))
    engine.start()
    try:
        if later:
            with out.cv:
                assert out.cv.wait_for(lambda: requests[0][0] in out.got, 300)
            for request_id, params, payload in later:
                engine.add(Sequence(request_id, params, payload))
        out.wait(*[r[0] for r in [*requests, *later]])
    finally:
        engine.stop()
    return out.got, steps


@pytest.fixture(scope="module")
def long_inputs(processor):
    text = " ".join(f"word{i % 97} and" for i in range(300))  # ~2.3 chunks of thinker tokens
    inputs = prepare_inputs(processor, oracle.messages("text", text))
    assert 2 * CHUNK_TOKENS < inputs["input_ids"].shape[1] < 3 * CHUNK_TOKENS
    return inputs


@pytest.fixture(scope="module")
def long_want(hf_model, long_inputs):
    """generate()'s text tokens and codec codes on the long prompt."""
    return oracle.generate(hf_model, long_inputs, REPLY, FRAMES)[:2]


@pytest.fixture(scope="module")
def long_kv(hf_model, long_inputs):
    """The thinker's K/V of the long prompt from transformers' forward over all of it: [layers] of [heads, L, d]."""
    with torch.inference_mode():
        past = hf_model.thinker(input_ids=long_inputs["input_ids"], use_cache=True).past_key_values
    return [layer.keys[0] for layer in past.layers], [layer.values[0] for layer in past.layers]


def assert_same_kv(got, want):
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g[0], w, rtol=1e-4, atol=1e-4)


def test_a_long_prompt_prefilled_in_pieces_beside_a_running_stream_matches_generate(hf_model, processor, long_inputs,
                                                                                    long_want, long_kv):  # fmt: skip
    """A one-chunk budget per step: the long prompt goes in three pieces of whole chunks (the last its
    prompt's rest), the short stream beside it decodes in the steps between them, and both replies, text
    tokens and codec codes, equal generate()'s on each prompt alone."""
    short_inputs = prepare_inputs(processor, oracle.messages("text"))
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    n = long_inputs["input_ids"].shape[1]
    got, steps = serve(thinker, CHUNK_TOKENS, [
        ("short", SamplingParams(max_tokens=2 * REPLY, ignore_eos=True),
         ThinkerPrompt(short_inputs["input_ids"][0], export_talker=True)),
        ("long", SamplingParams(max_tokens=REPLY, ignore_eos=True),
         ThinkerPrompt(long_inputs["input_ids"][0], export_talker=True)),
    ])  # fmt: skip
    assert steps.pieces("long") == [(0, CHUNK_TOKENS), (CHUNK_TOKENS, 2 * CHUNK_TOKENS), (2 * CHUNK_TOKENS, n)]
    assert steps.decodes_between_pieces("long", "short") == [1, 1]  # a decode step in every gap
    last_piece = max(i for i, (phase, p) in enumerate(steps.log) if phase == "prefill" and "long" in p)
    assert not any(phase == "decode" and "long" in p for phase, p in steps.log[:last_piece])  # mid-prefill: no decode
    assert got["long"].prompt_tokens == n
    assert_same_kv(steps.kv["long"], long_kv)
    want_text, want_codes = long_want
    assert got["long"].token_ids == want_text
    assert got["short"].token_ids == oracle.generate(hf_model, short_inputs, 2 * REPLY, FRAMES)[0]

    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **RUNNER)
    out = got["long"]
    prompt = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
    rows = talker.prompt_tokens(Sequence("x", SamplingParams(), prompt))
    params = SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05)
    codes, steps = serve(talker, CHUNK_TOKENS, [("long", params, prompt)])
    assert steps.pieces("long") == [(0, CHUNK_TOKENS), (CHUNK_TOKENS, 2 * CHUNK_TOKENS), (2 * CHUNK_TOKENS, rows)]
    assert torch.equal(codes["long"].codes, want_codes)


@pytest.mark.parametrize("joined", [True, False], ids=["in_the_decode_forward", "forward_of_its_own"])
def test_beside_a_running_stream_a_long_prompt_goes_in_units_and_matches_generate(hf_model, processor, long_inputs,
                                                                                  long_want, long_kv, joined):  # fmt: skip
    """With a bound on what pieces attend beside decodes that leaves room for one unit at the prompt's
    start and none beyond what a step must give: while the short stream decodes, the long prompt goes
    PIECE_TOKENS at a time, its last piece the rest (test_scheduler.py has the chunks that follow once
    nothing decodes). Its reply and K/V are generate()'s, whether its pieces run in the decode step's
    forward or, where no graph of their shape is captured beside it (LongPrefill.joins), in their own."""
    short_inputs = prepare_inputs(processor, oracle.messages("text"))
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    thinker.long_prefill.joins = lambda pieces, decode_shape: joined
    n = long_inputs["input_ids"].shape[1]
    short = ("short", SamplingParams(max_tokens=64, ignore_eos=True), ThinkerPrompt(short_inputs["input_ids"][0]))
    long = ("long", SamplingParams(max_tokens=REPLY, ignore_eos=True), ThinkerPrompt(long_inputs["input_ids"][0]))
    got, steps = serve(thinker, 4 * CHUNK_TOKENS, [short], later=[long], piece_tokens=PIECE_TOKENS,
                       attended_beside_decodes=PIECE_TOKENS * PIECE_TOKENS)  # fmt: skip
    pieces = steps.pieces("long")
    beside = [p["long"] for (phase, p), (after, q) in zip(steps.log, steps.log[1:])
              if phase == "prefill" and "long" in p and after == "decode" and "short" in q]  # fmt: skip
    assert len(beside) >= 2 and all(b - a == PIECE_TOKENS for a, b in beside if b < n)
    assert pieces[0] == (0, PIECE_TOKENS) and pieces[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    assert got["long"].token_ids == long_want[0] and got["short"].token_ids == \
        oracle.generate(hf_model, short_inputs, 64, FRAMES)[0]  # fmt: skip
    assert_same_kv(steps.kv["long"], long_kv)


def test_pieces_beside_decodes_go_through_the_decode_step_s_forward(hf_model, processor, long_inputs):
    """While a short stream decodes, each piece of a long prompt goes through the decode step's forward: one
    call of each layer's MLP (the experts) over the decode rows and the piece's tokens together, so that a
    step reads the experts' weights once (layer_stack.run_joint), not once for the piece and once for the
    decode."""
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    steps = decode_forwards(thinker)
    short = prepare_inputs(processor, oracle.messages("text"))["input_ids"][0]
    serve(thinker, 4 * CHUNK_TOKENS, [("short", SamplingParams(max_tokens=64, ignore_eos=True), ThinkerPrompt(short))],
          later=[("long", SamplingParams(max_tokens=2, ignore_eos=True), ThinkerPrompt(long_inputs["input_ids"][0]))],
          piece_tokens=PIECE_TOKENS, attended_beside_decodes=PIECE_TOKENS * PIECE_TOKENS)  # fmt: skip
    ridden = [tokens for riders, tokens in steps if riders]
    assert len(ridden) >= 2 and all(len(t) == 1 for t in ridden) and max(t[0] for t in ridden) > PIECE_TOKENS
    assert thinker.stats()["pieces_in_decode"] == len(ridden)


@torch.inference_mode()
def test_short_rows_go_after_every_piece_s_chunks(hf_model, long_inputs, long_kv):
    """Two long prompts in one step, one whose rest after its chunks fits a unit's bucket (76 tokens) and one
    whose rest does not (156): the short row runs after both prompts' chunk rows, and both slots hold their
    prompts' K/V as one forward over each gives them."""
    ids = long_inputs["input_ids"][0]
    short_rest = ids[: 2 * CHUNK_TOKENS + 76]
    past = hf_model.thinker(input_ids=short_rest[None], use_cache=True).past_key_values
    want = [layer.keys[0] for layer in past.layers], [layer.values[0] for layer in past.layers]
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    forwards = []
    run = thinker.long_prefill.rows.run
    thinker.long_prefill.rows.run = lambda embeds, *a, **k: forwards.append([e.shape[0] for e in embeds]) or \
        run(embeds, *a, **k)  # fmt: skip
    got, steps = serve(thinker, 8 * CHUNK_TOKENS, [
        ("a", SamplingParams(max_tokens=1), ThinkerPrompt(short_rest)),
        ("b", SamplingParams(max_tokens=1), ThinkerPrompt(ids)),
    ])  # fmt: skip
    assert steps.pieces("a") == [(0, short_rest.numel())] and steps.pieces("b") == [(0, ids.numel())]
    assert sorted(sum(forwards, []))[:1] == [76] and forwards[-1] == [76]  # the unit-sized row last
    assert_same_kv(steps.kv["a"], want)
    assert_same_kv(steps.kv["b"], long_kv)


def test_a_long_prompt_prefilled_in_one_step_matches_generate(hf_model, long_inputs, long_want, long_kv):
    """With the budget for all of it, a long prompt's chunks run as rows of one step's forwards (each row
    reading the rows before it, in the same forward or an earlier one): the same reply and K/V as
    generate()'s forward."""
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    thinker.long_prefill.rows.max_attended = 4096  # rows at 0 and 512 together (2 x 1024), the third alone
    n = long_inputs["input_ids"].shape[1]
    got, steps = serve(thinker, 4 * CHUNK_TOKENS, [
        ("long", SamplingParams(max_tokens=REPLY, ignore_eos=True), ThinkerPrompt(long_inputs["input_ids"][0])),
    ])  # fmt: skip
    assert steps.pieces("long") == [(0, n)]
    assert got["long"].token_ids == long_want[0]
    assert_same_kv(steps.kv["long"], long_kv)


def test_rows_go_in_forwards_that_bound_rows_times_attended_positions(hf_model):
    """With graphs' buckets (set by hand on the CPU): consecutive rows share a forward while its bucketed
    rows x kv positions stay within the bound, so rows that attend far go in smaller forwards."""
    long = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER).long_prefill
    long.rows.row_buckets, long.rows.max_attended = [1, 2, 4, 8, 16], 4096
    row = lambda start, tokens: (0, types.SimpleNamespace(embeds=torch.zeros(tokens, 1)), 0, start)  # noqa: E731
    rows = [row(start, CHUNK_TOKENS) for start in range(0, 4 * CHUNK_TOKENS, CHUNK_TOKENS)]
    # 2 rows x 1024 positions; a third would make 4 (bucket) x 2048: the next forward, 2 x 2048
    assert [[r[3] for r in g] for g in long._groups(rows)] == [[0, 512], [1024, 1536]]
    # a unit's rows never share a forward with whole chunks, which would pad them to a chunk
    rows = [row(0, CHUNK_TOKENS), row(512, PIECE_TOKENS), row(640, PIECE_TOKENS)]
    assert [[r[3] for r in g] for g in long._groups(rows)] == [[0], [512, 640]]


@pytest.mark.gpu
@torch.inference_mode()
def test_long_prefill_graphs_in_pieces_equal_one_eager_pass_on_cuda(tiny_checkpoint, long_inputs):
    """As served on CUDA (bf16, graphs, rows padded to their buckets, the paged prefill kernel): a long
    prompt prefilled in pieces leaves the K/V and the logits of the prompt prefilled whole at exact sizes
    without graphs, within bf16 rounding."""
    prompt = ThinkerPrompt(long_inputs["input_ids"][0])
    result, whole, graphs, eager = pieces_as_graphs_and_whole_eager_on_cuda(tiny_checkpoint, prompt)
    n = prompt.input_ids.numel()
    assert_close_in_bf16(slot_kv(graphs.cache, 1, n), slot_kv(eager.cache, 1, n))
    assert_same_pick_in_bf16(graphs, eager, result, whole)


@pytest.mark.gpu
@torch.inference_mode()
def test_long_pieces_beside_a_decode_on_cuda_equal_one_eager_pass(tiny_checkpoint, processor, long_inputs):
    """As served on CUDA (bf16, the fused kernels, graphs captured): a long prompt's pieces that ride a short
    stream's decode steps (one eager forward with its rows padded to the decode's bucket) leave the K/V and
    the logits of the prompt prefilled whole, within bf16 rounding."""
    prompt = ThinkerPrompt(long_inputs["input_ids"][0])
    short = ThinkerPrompt(prepare_inputs(processor, oracle.messages("text"))["input_ids"][0])
    result, whole, graphs, eager = pieces_as_graphs_and_whole_eager_on_cuda(tiny_checkpoint, prompt, beside=short)
    n = prompt.input_ids.numel()
    assert_close_in_bf16(slot_kv(graphs.cache, 1, n), slot_kv(eager.cache, 1, n))
    assert_same_pick_in_bf16(graphs, eager, result, whole)


def assert_close_in_bf16(got: torch.Tensor, want: torch.Tensor, tol: float = 0.05) -> None:
    """Equal within bf16 rounding, but for at most one element in a thousand: two passes that cut a prompt
    differently round their products differently, and where a token's router scores nearly tie, one pass
    may send it to another expert, which moves that token's rows (on an H100: 7 of 37,760 K values of one
    position). A pass that attends wrongly moves every position after its error."""
    off = ~torch.isclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert off.float().mean().item() <= 1e-3, f"{off.sum().item()} of {off.numel()} values differ"


def assert_same_pick_in_bf16(graphs, eager, result, whole) -> None:
    """The last prefill's logits of the two runners agree within bf16 rounding, and each picked token holds
    the top logit of the other's within it (random weights leave near ties at the top)."""
    got, want = graphs.last_logits, eager.last_logits
    assert_close_in_bf16(got, want)
    for token, logits in ((result.output.token_ids[0], want), (whole.output.token_ids[0], got)):
        assert logits[token].item() >= logits.max().item() - 0.05, (token, logits.topk(3))


def recording_logits(runner):
    """Keeps the logits of the runner's last sampling step as runner.last_logits (one row, float32)."""
    sample = runner._sample

    def _sample(logits, seqs):
        runner.last_logits = logits[0].float().clone()
        return sample(logits, seqs)

    runner._sample = _sample
    return runner


@torch.inference_mode()
def test_a_paged_prefill_refuses_an_attention_that_would_read_it_without_its_causal_limit(hf_model, long_inputs,
                                                                                         monkeypatch):  # fmt: skip
    """Where the paged prefill kernel serves (CUDA), a long prompt's rows build no mask: an attention that
    reads their K/V through update() instead of the kernel (transformers' own, on a model without the fused
    kernels) would let each token see the tokens after it. Such a step raises instead of prefilling wrong."""
    from omnistage.models import paged_attention

    monkeypatch.setattr(paged_attention, "serves", lambda device: True)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)  # on the CPU: no fused kernels
    seq = Sequence("long", SamplingParams(max_tokens=REPLY), ThinkerPrompt(long_inputs["input_ids"][0]), slot=1)
    thinker.validate(seq)
    seq.prompt_len = seq.payload.input_ids.numel()
    seq.chunk, seq.prefilled = PIECE_TOKENS, PIECE_TOKENS
    with pytest.raises(RuntimeError, match="fused attention"):
        thinker.prefill([seq])


def pieces_as_graphs_and_whole_eager_on_cuda(tiny_checkpoint, prompt: ThinkerPrompt, beside=None) -> tuple:
    """A long prompt prefilled in slot 1 of two bf16 thinker runners on CUDA: one replaying graphs, in pieces
    as the scheduler hands them over (a unit beside decodes, a chunk off the chunk grid, then the rest), one
    eager at exact sizes, whole. beside: a prompt prefilled in slot 0 first, whose decode steps the pieces
    then ride (ThinkerRunner.decode's riders).
    Returns the last piece's and the whole prefill's StepResult, and the two runners (graphed, eager)."""
    from omnistage.models.checkpoint import load_config, load_stage

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    kw = dict(max_slots=2, max_seq_len=2000, device="cuda", dtype=torch.bfloat16)
    graphs = recording_logits(ThinkerRunner(model, config, cuda_graphs=True, **kw))
    eager = recording_logits(ThinkerRunner(model, config, **kw))
    graphs.capture_graphs()
    n = prompt.input_ids.numel()
    pieced, whole = (Sequence(name, SamplingParams(max_tokens=REPLY), prompt, slot=1) for name in "gw")
    graphs.validate(pieced)
    eager.validate(whole)
    pieced.prompt_len = n
    if beside is not None:
        short = Sequence("s", SamplingParams(max_tokens=64, ignore_eos=True), beside, slot=0)
        graphs.validate(short)
        graphs.prefill([short])
    for end in sorted({PIECE_TOKENS, min(PIECE_TOKENS + CHUNK_TOKENS, n), n}):  # no empty piece
        pieced.chunk, pieced.prefilled = end - pieced.prefilled, end
        if beside is None:
            [result] = graphs.prefill([pieced])
        else:
            decoded, result = graphs.decode([short], [pieced])
            assert decoded.seq is short and decoded.output is not None
        assert (result.output is None) == (end < n)
    [want] = eager.prefill([whole])
    return result, want, graphs, eager
