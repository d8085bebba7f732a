# The graph-capturable decode path (static buffers, batches padded to buckets, context read up to a
# bucket, residual codebooks picked in-graph) and the talker's static prefill (rows and tokens padded to
# buckets) give what generate() gives. CUDA graphs themselves only
# exist on a GPU (perf/graph_check.py compares graph and eager there); here the same functions run eagerly.
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.code_predictor import StaticCodePredictor, _sample_top_k_top_p
from omnistage.stages.cuda_graphs import batch_buckets, bucket_for, length_buckets
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import FRAMES, REPLY, run_talker, run_thinker, running


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1]
    assert length_buckets(3584) == [256, 512, 1024, 2048, 3584]
    assert bucket_for(17, batch_buckets(64)) == 24 and bucket_for(257, length_buckets(4096)) == 512


def pad_to_buckets(decoder, rows: list[int], kv: list[int]) -> None:
    decoder.row_buckets, decoder.kv_buckets = rows, kv


def test_padded_static_path_matches_generate(hf_model, processor):
    inputs = prepare_inputs(processor, oracle.messages("text"))
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    kw = dict(max_slots=8, max_seq_len=512, device="cpu", dtype=torch.float32)

    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    pad_to_buckets(thinker.decoder, [4, 8], [256, 512])  # slot 2 runs as 4 rows reading 256 positions
    thinker.static_prefill.row_buckets, thinker.static_prefill.token_buckets = [2], [64, 512]  # 2 rows x 512
    thinker._long_pieces = None  # a text prompt must take the static prefill
    prompt = ThinkerPrompt(inputs["input_ids"][0], export_talker=True)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY), prompt, slot=2))
    assert out.token_ids == want_text

    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    pad_to_buckets(talker.decoder, [8], [512])
    # the prompt prefills as row 0 of 4 (rows 1-3 repeat it into the same slot), right-padded to 512 tokens
    talker.static_prefill.row_buckets, talker.static_prefill.token_buckets = [4], [512]
    talker._prefill_long = None  # a text prompt must take the static prefill
    hidden = hf_model.config.talker_config.text_config.hidden_size
    talker.static_predictor = StaticCodePredictor(talker.predictor, 8, hidden, cuda_graphs=False)
    talker.static_predictor.buckets = [4, 8]
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
    codes, _ = run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 5))
    assert torch.equal(codes, want_codes)


def test_in_graph_sampling_keeps_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    draws = torch.stack([_sample_top_k_top_p(logits, 50, 0.8) for _ in range(400)])  # [400, 4]
    for row in range(4):
        kept = logits[row].topk(50).indices
        probs = logits[row, kept].softmax(-1)
        order = probs.argsort(descending=True)
        nucleus = kept[order[: int((probs[order].cumsum(0) < 0.8).sum()) + 1]]
        assert set(draws[:, row].tolist()) <= set(nucleus.tolist())
        assert len(set(draws[:, row].tolist())) > 1  # it samples, not argmax


def test_text_prompts_prefilled_together_match_generate(hf_model, processor):
    """Two text prompts of different lengths share one right-padded prefill, then decode side by side;
    each gets generate()'s tokens and codes, and the same talker conditioning as a lone prefill."""
    texts = ["Say hello!", "Tell me a long story about the sea, please, in three short sentences."]
    inputs = [prepare_inputs(processor, oracle.messages("text", t)) for t in texts]
    assert inputs[0]["input_ids"].shape[1] != inputs[1]["input_ids"].shape[1]
    kw = dict(max_slots=4, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    seqs = [running(f"t{i}", SamplingParams(max_tokens=REPLY), ThinkerPrompt(x["input_ids"][0], export_talker=True), i)
            for i, x in enumerate(inputs)]  # fmt: skip
    results = thinker.prefill(seqs)
    outs = {r.seq.request_id: r.output for r in results}
    while all(r.finish_reason is None for r in results):
        results = thinker.decode(seqs)
        for r in results:
            outs[r.seq.request_id] = outs[r.seq.request_id].merge(r.output)
    alone = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    talker_seqs = []
    for i, x in enumerate(inputs):
        out = outs[f"t{i}"]
        assert out.token_ids == oracle.generate(hf_model, x, REPLY, FRAMES)[0]
        lone, _ = run_thinker(alone, running("x", SamplingParams(max_tokens=REPLY), ThinkerPrompt(x["input_ids"][0], export_talker=True), 3))
        assert torch.allclose(out.text_rows, lone.text_rows)
        assert torch.allclose(out.talker.media_rows, lone.talker.media_rows, atol=1e-5)
        assert torch.allclose(out.talker.special_rows, lone.talker.special_rows, atol=1e-5)
        tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
        talker_seqs.append(running(f"a{i}", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 2 - i))
    # both talker prompts (different lengths) in one padded prefill, then decoded side by side
    results, frames = talker.prefill(talker_seqs), {s.request_id: [] for s in talker_seqs}  # with frame 0
    while results:
        for r in results:
            frames[r.seq.request_id].append(r.output.codes)
        live = [r.seq for r in results if r.finish_reason is None]
        results = talker.decode(live) if live else []
    for i, x in enumerate(inputs):
        assert torch.equal(torch.cat(frames[f"a{i}"]), oracle.generate(hf_model, x, REPLY, FRAMES)[1])


def test_code_predictor_greedy_rows_pick_alike_with_or_without_sampled_rows(hf_model):
    """A batch of greedy rows runs the variant without sampling kernels; beside a sampled row (the other
    variant) the greedy rows still get the same codebooks, and the sampled row draws from its logits."""
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, max_slots=4, max_seq_len=64, device="cpu",
                          dtype=torch.float32)  # fmt: skip
    hidden = hf_model.config.talker_config.text_config.hidden_size
    predictor = StaticCodePredictor(talker.predictor, 4, hidden, cuda_graphs=False)
    calls = []
    predictor.bank.run = lambda key, fn: (calls.append(key), fn())
    g = torch.Generator().manual_seed(3)
    past_hidden, c0 = torch.randn(3, hidden, generator=g), torch.tensor([5, 9, 17])
    greedy_codes = predictor(past_hidden, c0, [True, True, True])[0].clone()
    torch.manual_seed(0)
    mixed = [predictor(past_hidden, c0, [True, False, True])[0].clone() for _ in range(8)]
    assert calls == [(3, False)] + [(3, True)] * 8
    for codes in mixed:
        assert torch.equal(codes[[0, 2]], greedy_codes[[0, 2]]) and codes[1, 0] == 9
    assert len({tuple(codes[1].tolist()) for codes in mixed}) > 1  # the sampled row samples
