# The stage runners against transformers' generate() on the tiny checkpoint (greedy, forced lengths):
# same reply tokens, same codec codes, for text, text+image and text+audio prompts.
import pytest
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Sequence, SeqStatus
from omnistage.models.processor import prepare_inputs
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle

REPLY, FRAMES = 6, 10


def running(request_id, params, payload, slot):
    seq = Sequence(request_id, params, payload, slot=slot)
    seq.status = SeqStatus.RUNNING
    return seq


def slot_kv(cache, slot: int, n: int) -> torch.Tensor:
    """The first n positions of a slot of a paged cache, read through its block table: [2 * layers, H, n, D]."""
    k, v = cache.read(slot, n)
    return torch.cat(k + v)


def run_thinker(runner, seq):
    results = runner.prefill([seq])
    out = results[0].output
    while results[0].finish_reason is None:
        results = runner.decode([seq])
        out = out.merge(results[0].output)
    return out, results[0].finish_reason


def run_talker(runner, seq):
    results, frames = runner.prefill([seq]), []  # the prefill completes frame 0
    while True:
        if results[0].output is not None:
            frames.append(results[0].output.codes)
        if results[0].finish_reason is not None:
            break
        results = runner.decode([seq])
    return torch.cat(frames), results[0].finish_reason


def assert_runners_match_generate(model, hf_model, processor, thinker_slot: int, talker_slot: int) -> None:
    """The thinker and talker runners on `model` (a changed copy of hf_model) give generate()'s text tokens
    and codec codes on hf_model for the text prompt."""
    inputs = prepare_inputs(processor, oracle.messages("text"))
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    kw = {"max_slots": 4, "max_seq_len": 512, "device": "cpu", "dtype": torch.float32}
    thinker = ThinkerRunner(model.thinker, model.config, **kw)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY),
                                          ThinkerPrompt(inputs["input_ids"][0], export_talker=True), thinker_slot))  # fmt: skip
    assert out.token_ids == want_text
    talker = TalkerRunner(model.talker, model.config, model.thinker.get_input_embeddings().weight, **kw)
    prompt = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
    params = SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05)
    codes, _ = run_talker(talker, running("a", params, prompt, talker_slot))
    assert torch.equal(codes, want_codes)


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
def test_thinker_and_talker_match_generate(kind, hf_model, processor):
    inputs = prepare_inputs(processor, oracle.messages(kind))
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)

    kw = dict(max_slots=4, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    prompt = ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                           inputs.get("input_features"), inputs.get("feature_attention_mask"), export_talker=True)
    out, reason = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY), prompt, slot=2))
    assert out.token_ids == want_text and reason == "length"
    assert out.text_rows.shape == (REPLY, hf_model.config.thinker_config.text_config.hidden_size)

    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"), lengths)
    codes, reason = run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 1))
    assert reason == "length"
    assert torch.equal(codes, want_codes)


def test_talker_prefills_prompts_of_different_kinds_and_lengths_together(hf_model, processor, monkeypatch):
    """One talker prefill of two text-only prompts of different lengths (built in one pass), an image prompt
    and an audio prompt, in one batched forward (the media rows at their own MRoPE positions, none through
    the eager forward), then their decode steps together: each gets the codec codes generate() gives it
    alone."""
    kw = dict(max_slots=4, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    monkeypatch.setattr(talker, "_prefill_long", lambda *a: pytest.fail("a talker prompt prefilled in chunks"))
    seqs, want = [], {}
    for i, (kind, text) in enumerate([("text", "Say hello!"), ("image", "Say hello!"), ("audio", "Answer it."),
                                      ("text", "Please read this much longer sentence out loud, slowly.")]):  # fmt: skip
        inputs = prepare_inputs(processor, oracle.messages(kind, text))
        prompt = ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                               inputs.get("input_features"), inputs.get("feature_attention_mask"),
                               export_talker=True)  # fmt: skip
        out, _ = run_thinker(thinker, running(f"t{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i))
        lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
        tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"), lengths)
        seqs.append(running(f"a{i}", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, slot=i))
        want[f"a{i}"] = oracle.generate(hf_model, inputs, REPLY, FRAMES)[1]
    frames = {s.request_id: [] for s in seqs}
    results = talker.prefill(seqs)
    while True:
        for r in results:
            if r.output is not None:
                frames[r.seq.request_id].append(r.output.codes)
        going = [r.seq for r in results if r.finish_reason is None]
        if not going:
            break
        results = talker.decode(going)
    for request_id, codes in frames.items():
        assert torch.equal(torch.cat(codes), want[request_id]), request_id


def test_talker_waits_for_text_it_has_not_received(hf_model, processor):
    """Streaming text into the talker row by row gives the same frames as handing it all at once, and frame k
    goes out once rows 0..k-1 are in: one row ahead of the text it reads back with row k."""
    inputs = prepare_inputs(processor, oracle.messages("text"))
    _, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    kw = dict(max_slots=2, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY),
                                          ThinkerPrompt(inputs["input_ids"][0], export_talker=True), 0))  # fmt: skip
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    rows = list(out.text_rows.unbind(0))
    prompt = TalkerPrompt(out.talker, 2302, rows[:1])
    seq = running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), prompt, 0)
    [first] = talker.prefill([seq])
    frames, fed = [first.output.codes], 1  # frame 0 leaves with the prefill, on row 0 alone
    assert frames[0].shape == (1, 16) and first.finish_reason is None
    while True:
        if not talker.is_ready(seq):
            assert fed <= len(rows)
            prompt.append(torch.stack(rows[fed : fed + 1]) if fed < len(rows) else None, fed >= len(rows))
            fed += 1
            continue
        result = talker.decode([seq])[0]
        if result.output is not None:  # None: the step read back a frame sent before
            frames.append(result.output.codes)
            assert len(prompt.text) == min(len(frames), len(rows)), (len(frames), len(prompt.text))
        if result.finish_reason:
            break
    assert torch.equal(torch.cat(frames), want_codes)


def test_talker_eos_ends_the_stream_without_a_frame_for_it(hf_model, processor):
    """Frames are completed right after their codebook 0 is picked, in the same step: one picked as EOS
    ends the stream with the frames before it, and nothing is completed from the EOS itself."""
    inputs = prepare_inputs(processor, oracle.messages("text"))
    kw = dict(max_slots=2, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY),
                                          ThinkerPrompt(inputs["input_ids"][0], export_talker=True), 0))  # fmt: skip

    def speak(eos=None):
        talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
        if eos is not None:
            talker.eos = eos  # a codebook-0 token of the full run stands in for EOS
        prompt = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
        return run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), prompt, 1))

    codes, reason = speak()
    assert reason == "length" and codes.shape[0] == FRAMES
    # the first frame from frame 3 on whose codebook-0 token is new: picking it again ends the stream there
    k = next(k for k in range(2, FRAMES) if codes[k, 0] not in codes[:k, 0])
    stopped, reason = speak(eos=int(codes[k, 0]))
    assert reason == "stop"
    assert torch.equal(stopped, codes[:k])


def test_a_warmed_up_runner_serves_as_a_fresh_one(hf_model, processor, monkeypatch):
    """warm_up (run while a stage loads, so that ready means warm) serves a text turn and, together, an audio,
    an image and a video turn (both encoders, the vision one on a picture and on frames in one call, the
    batched media prefill, the talker's prompts from media turns), and
    leaves no trace: every slot is free, the thinker's prefix cache saw nothing, and the next request, in
    the slot the warm-up used, still equals generate()."""
    inputs = prepare_inputs(processor, oracle.messages("text"))
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    kw = dict(max_slots=4, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, prefix_cache_bytes=1 << 20, **kw)
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    encoded, media_rows = [], []
    for name in ("audio", "vision"):
        encoder = getattr(thinker.media, name)
        monkeypatch.setattr(thinker.media, name, lambda *a, _e=encoder: encoded.append(a) or _e(*a))
    build = talker.prompts.build  # the talker's prompts: how many media rows each brings
    spy = lambda seqs: media_rows.extend(int(s.payload.cond.user_is_mm.sum()) for s in seqs) or build(seqs)  # noqa: E731
    monkeypatch.setattr(talker.prompts, "build", spy)
    thinker.warm_up()
    talker.warm_up()
    assert len(encoded) == 2 and len(media_rows) == 4 and media_rows[0] == 0 and all(n > 0 for n in media_rows[1:])
    grids = encoded[1][1]  # the vision call's grids: the picture's and the video's (several frames)
    assert len(grids) == 2 and sorted(int(g[0]) for g in grids) == [1, 2]
    assert thinker.slots == talker.slots == [None] * 4
    assert thinker.stats()["prefix_prompt_tokens"] == 0
    prompt = ThinkerPrompt(inputs["input_ids"][0], export_talker=True)
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY), prompt, slot=0))
    assert out.token_ids == want_text
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
    codes, _ = run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 0))
    assert torch.equal(codes, want_codes)


def test_thinker_prefills_text_audio_and_image_prompts_in_one_batched_forward(hf_model, processor, monkeypatch):
    """One thinker prefill of text, audio and image prompts (clips of different lengths), none through the
    per-request eager forward, then their decode steps together and the talker on each: every prompt gets
    the text tokens and codec codes generate() gives it alone."""
    monkeypatch.setattr(ThinkerRunner, "_long_pieces", lambda self, seqs: pytest.fail("a prompt prefilled in chunks"))
    longer_clip = {"type": "input_audio", "input_audio": {"data": oracle.wav_base64(seconds=2.3, seed=5), "format": "wav"}}
    conversations = [oracle.messages("text"), oracle.messages("audio"), oracle.messages("image"),
                     [oracle.SYSTEM, {"role": "user", "content": [longer_clip, {"type": "text", "text": "And this one?"}]}]]  # fmt: skip
    kw = dict(max_slots=5, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    inputs = [prepare_inputs(processor, c) for c in conversations]
    seqs = [running(f"t{i}", SamplingParams(max_tokens=REPLY),
                    ThinkerPrompt(x["input_ids"][0], x.get("pixel_values"), x.get("image_grid_thw"), x.get("input_features"),
                                  x.get("feature_attention_mask"), export_talker=True), slot=i + 1)
            for i, x in enumerate(inputs)]  # fmt: skip
    outs, results = {}, thinker.prefill(seqs)
    while True:
        for r in results:
            outs[r.seq.request_id] = outs[r.seq.request_id].merge(r.output) if r.seq.request_id in outs else r.output
        going = [r.seq for r in results if r.finish_reason is None]
        if not going:
            break
        results = thinker.decode(going)
    for i, x in enumerate(inputs):
        want_text, want_codes, _ = oracle.generate(hf_model, x, REPLY, FRAMES)
        out = outs[f"t{i}"]
        assert out.token_ids == want_text, i
        lengths = x["feature_attention_mask"].sum(-1) if "feature_attention_mask" in x else None
        tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, x.get("image_grid_thw"), lengths)
        codes, _ = run_talker(talker, running(f"a{i}", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, 0))
        assert torch.equal(codes, want_codes), i


@pytest.mark.parametrize("joined", [True, False], ids=["in_the_decode_forward", "forward_of_its_own"])
def test_talker_prompts_beside_a_running_stream_ride_its_decode_and_match_generate(joined, hf_model, processor):
    """A text and an image turn's talker prompts arrive while a stream speaks, one in a slot below the
    stream's that a finished request freed: they prefill in the decode step's forward (one call of each
    layer's MLP), their frame 0 completed with the stream's frame; or, where no shape is captured beside the
    decode (LongPrefill.joins), in a forward of their own first. Either way each one's codes are generate()'s."""
    from .test_chunked_prefill import decode_forwards, serve

    kw = dict(max_slots=4, max_seq_len=512, device="cpu", dtype=torch.float32)
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **kw)
    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **kw)
    if not joined:
        talker.long_prefill.joins = lambda *shape: False
    frames = {"x": 1, "stream": 14, "text": FRAMES, "image": FRAMES}  # x (slot 0) ends at its prefill
    requests, want = {}, {}
    turns = [("x", "text", "Hi."), ("stream", "text", "Read this out."), ("text", "text", "Say hello!"),
             ("image", "image", "What is it?")]  # fmt: skip
    for i, (key, kind, text) in enumerate(turns):
        inputs = prepare_inputs(processor, oracle.messages(kind, text))
        prompt = ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                               export_talker=True)  # fmt: skip
        out, _ = run_thinker(thinker, running(f"t{i}", SamplingParams(max_tokens=REPLY), prompt, slot=0))
        tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"))
        params = SamplingParams(max_tokens=frames[key], repetition_penalty=1.05)
        requests[key] = (key, params, tp)
        want[key] = oracle.generate(hf_model, inputs, REPLY, frames[key])[1]
    steps, prefilled, prefill_batch = decode_forwards(talker), [], talker._prefill_batch
    talker._prefill_batch = lambda seqs: prefilled.extend(s.request_id for s in seqs) or prefill_batch(seqs)
    got, _ = serve(talker, 1024, [requests["x"], requests["stream"]], later=[requests["text"], requests["image"]])
    ridden = [(ids, mlp_calls) for ids, mlp_calls in steps if ids]
    assert sorted(i for ids, _ in ridden for i in ids) == ["image", "text"]
    # joined: the decode rows (3 slots) and the prompts' rows in one call; else the prompts' own prefill first
    assert all((len(calls) == 1 and calls[0] > 3) == joined for _, calls in ridden), ridden
    assert sorted(prefilled) == sorted(["stream", "x"] + (["image", "text"] if not joined else []))
    assert talker.stats()["prompts_in_decode"] == (2 if joined else 0)
    for key, codes in want.items():
        assert torch.equal(got[key].codes, codes), key


@pytest.mark.gpu
@torch.inference_mode()
def test_talker_prompts_riding_a_decode_on_cuda_equal_their_eager_prefill(tiny_checkpoint, hf_model, processor):
    """As served on CUDA (bf16, the fused kernels, graphs captured): a text and an image turn's talker prompts
    that ride a stream's decode step replay a graph captured beside it, and leave the K/V of an eager prefill
    of each, within bf16 rounding; the stream's decode row is the one it takes alone."""
    from omnistage.models.checkpoint import load_config, load_stage, load_text_embeddings

    from .test_chunked_prefill import assert_close_in_bf16

    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=1, max_seq_len=512, device="cpu",
                            dtype=torch.float32)  # fmt: skip
    prompts = []
    for i, (kind, text) in enumerate([("text", "Read this out."), ("text", "Say hello!"), ("image", "What is it?")]):
        inputs = prepare_inputs(processor, oracle.messages(kind, text))
        prompt = ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                               export_talker=True)  # fmt: skip
        out, _ = run_thinker(thinker, running(f"t{i}", SamplingParams(max_tokens=REPLY), prompt, slot=0))
        rows = list(out.text_rows.unbind(0))
        prompts.append(TalkerPrompt(out.talker, 2302, rows, True, inputs.get("image_grid_thw")))
        thinker.release(running(f"t{i}", SamplingParams(), prompt, slot=0))
    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "talker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    table = load_text_embeddings(str(tiny_checkpoint), device="cuda")
    kw = dict(max_slots=4, max_seq_len=512, device="cuda", dtype=torch.bfloat16)
    graphs, eager = TalkerRunner(model, config, table, cuda_graphs=True, **kw), TalkerRunner(model, config, table, **kw)
    graphs.capture_graphs()
    params = SamplingParams(max_tokens=FRAMES, ignore_eos=True)
    stream, alone = (running("s", params, prompts[0], slot=1) for _ in range(2))
    graphs.prefill([stream])
    eager.prefill([alone])
    riders = [running(f"r{i}", params, p, slot=slot) for i, (p, slot) in enumerate(zip(prompts[1:], (0, 2)))]
    assert graphs.riders(riders) == riders
    decoded, *ridden = graphs.decode([stream], riders)
    eager.decode([alone])
    assert graphs.stats()["prompts_in_decode"] == 2 and decoded.seq is stream
    assert_close_in_bf16(graphs.decoder.logits_out[1].float(), eager.decoder.logits_out[1].float())
    for seq, result in zip(riders, ridden):
        assert result.seq is seq and result.output.codes.shape == (1, 16)
        ref = running(f"e{seq.request_id}", params, seq.payload, slot=3)
        eager.prefill([ref])
        n = graphs.prompt_tokens(seq)
        assert_close_in_bf16(slot_kv(graphs.cache, seq.slot, n), slot_kv(eager.cache, 3, n))
        eager.release(ref)
