# Prefix reuse for prompts with media on the tiny checkpoint: the prefix cache's keys carry each media item's
# content digest, so two different clips (or images) of one size never share K/V (each prefill equals a full
# one and generate()), and a conversation that resends an earlier turn with its clip takes that turn's K/V, media rows
# included, with generate()'s tokens and the talker conditioning of a full prefill.
import base64

import numpy as np
import pytest
import torch

from omnistage.core.prefix_index import BLOCK, PrefixIndex
from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import run_thinker, running, slot_kv

REPLY = 6
SYSTEM = {"role": "system", "content": "You are a helpful voice assistant; listen to the clip and answer. " * 2}
AUDIO_PAD, IMAGE_PAD = 151675, 151655
QUESTION = "What is it? Describe the sound in a few words, and say how long it lasts and how loud it is."


def _clip(seed: int) -> dict:
    return {"type": "input_audio", "input_audio": {"data": oracle.wav_base64(seconds=1.0, seed=seed), "format": "wav"}}


def _prompt(inputs) -> ThinkerPrompt:
    return ThinkerPrompt(inputs["input_ids"][0], inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                         inputs.get("input_features"), inputs.get("feature_attention_mask"), export_talker=True)


def _runner(hf_model, prefix_bytes):
    return ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=4, max_seq_len=512, device="cpu",
                         dtype=torch.float32, prefix_cache_bytes=prefix_bytes)  # fmt: skip


def test_two_clips_of_one_length_name_different_blocks_from_the_clips_block_on(hf_model, processor):
    a, b = (prepare_inputs(processor, [SYSTEM, {"role": "user", "content": [_clip(s), {"type": "text", "text": "Hi"}]}])
            for s in (1, 2))  # fmt: skip
    assert torch.equal(a["input_ids"], b["input_ids"])  # same placeholders: only the content differs
    runner = _runner(hf_model, 1 << 20)
    ids = a["input_ids"][0]
    names_a = PrefixIndex.names(ids.tolist(), runner.media_prefix.salts(_prompt(a), ids))
    names_b = PrefixIndex.names(ids.tolist(), runner.media_prefix.salts(_prompt(b), ids))
    first_media_block = int((ids == AUDIO_PAD).nonzero()[0]) // BLOCK
    assert names_a[:first_media_block] == names_b[:first_media_block]  # the system prompt is shared
    assert all(x != y for x, y in zip(names_a[first_media_block:], names_b[first_media_block:]))


def _same_kv(a: ThinkerRunner, b: ThinkerRunner, slot: int, n: int) -> None:
    torch.testing.assert_close(slot_kv(a.cache, slot, n), slot_kv(b.cache, slot, n), rtol=1e-4, atol=1e-5)


def _item(kind: str, variant: int) -> dict:
    """Two items of one kind and size that differ in content: images of random pixels, or a tone and a chirp."""
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": oracle.png_data_url(seed=variant)}}
    t = np.arange(16000) / 16000
    x = 0.9 * np.sin(2 * np.pi * (440 * t if variant == 1 else (100 + 3000 * t) * t))
    pcm = base64.b64encode((x * 32767).astype("<i2").tobytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": pcm, "format": "pcm"}}


@pytest.mark.parametrize("kind", ["audio", "image"])
@torch.inference_mode()
def test_a_different_item_of_the_same_size_is_never_served_from_the_cache(kind, hf_model, processor):
    # Each prefill is compared with a full one (no cache): reply tokens, K/V and the talker's conditioning.
    # The two items' K/V differ by far more than that comparison's tolerance, so K/V taken from the other
    # item would fail it (the tiny checkpoint's greedy tokens alone barely depend on a clip's content).
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    msgs = {v: [SYSTEM, {"role": "user", "content": [_item(kind, v), {"type": "text", "text": QUESTION}]}] for v in (1, 2)}
    inputs = {v: prepare_inputs(processor, m) for v, m in msgs.items()}
    assert torch.equal(inputs[1]["input_ids"], inputs[2]["input_ids"])
    pad = hf_model.config.thinker_config.audio_token_id if kind == "audio" else IMAGE_PAD
    first, last = (int(i) for i in (inputs[1]["input_ids"][0] == pad).nonzero()[[0, -1], 0])
    n = inputs[1]["input_ids"].shape[1]
    want = {v: oracle.generate(hf_model, inputs[v], REPLY, 2)[0] for v in (1, 2)}
    kv = {}
    for i, v in enumerate([1, 1, 1, 2, 2, 1]):
        hits_before, slot = cached.prefix.hit_tokens, i % 4
        seq = lambda name: running(name, SamplingParams(max_tokens=REPLY), _prompt(inputs[v]), slot=slot)  # noqa: E731
        got, _ = run_thinker(cached, seq(f"c{i}"))
        ref, _ = run_thinker(plain, seq(f"p{i}"))
        assert got.token_ids == want[v] == ref.token_ids, (i, v)
        torch.testing.assert_close(got.talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)
        _same_kv(cached, plain, slot, n)
        kv[v] = slot_kv(cached.cache, slot, n)
        hit = cached.prefix.hit_tokens - hits_before
        if i in (1, 4):  # media prompts' blocks are kept from their first sighting: the item's blocks too
            assert hit > last, (i, hit)
        if i == 3:  # the other item after three of the first: at most the blocks before it came from the cache
            assert hit <= first // BLOCK * BLOCK, hit
    assert not torch.allclose(kv[1], kv[2], rtol=1e-4, atol=1e-5)  # what a wrong reuse would show


@torch.inference_mode()
def test_a_resent_turn_with_its_clip_reuses_its_kv_and_talker_rows(hf_model, processor):
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    turn1 = [SYSTEM, {"role": "user", "content": [_clip(3), {"type": "text", "text": QUESTION}]}]
    turn2 = turn1 + [{"role": "assistant", "content": "A tone."}, {"role": "user", "content": "Say it again, slower."}]
    turn2b = turn1 + [{"role": "assistant", "content": "A tone."}, {"role": "user", "content": "And louder?"}]
    for i, msgs in enumerate([turn1, turn2, turn2b]):
        inputs = prepare_inputs(processor, msgs)
        want, _, _ = oracle.generate(hf_model, inputs, REPLY, 2)
        hits_before = cached.prefix.hit_tokens
        got, _ = run_thinker(cached, running(f"c{i}", SamplingParams(max_tokens=REPLY), _prompt(inputs), slot=i))
        ref, _ = run_thinker(plain, running(f"p{i}", SamplingParams(max_tokens=REPLY), _prompt(inputs), slot=i))
        assert got.token_ids == want == ref.token_ids, i
        torch.testing.assert_close(got.talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.text_rows, ref.text_rows, rtol=1e-4, atol=1e-5)
        last_media = int((inputs["input_ids"][0] == AUDIO_PAD).nonzero()[-1])
        assert (got.cached_tokens, ref.cached_tokens) == (cached.prefix.hit_tokens - hits_before, 0), i
        if i > 0:  # turn 1's blocks, clip included, were kept from turn 1 on
            assert cached.prefix.hit_tokens - hits_before > last_media, i


def _run_together(runner, seqs) -> dict:
    """One prefill step of all seqs, then decode steps of those still running; each one's merged output."""
    outs = {}
    live = []
    for r in runner.prefill(seqs):
        outs[r.seq.request_id] = r.output
        live += [r.seq] if r.finish_reason is None else []
    while live:
        results, live = runner.decode(live), []
        for r in results:
            outs[r.seq.request_id] = outs[r.seq.request_id].merge(r.output)
            live += [r.seq] if r.finish_reason is None else []
    for s in seqs:
        runner.release(s)
    return outs


@torch.inference_mode()
def test_a_step_of_prompts_with_seen_media_prefills_their_text_together(hf_model, processor):
    # A benchmark level that cycles its prompts, or voice sessions that all open with one greeting: prompts whose
    # media were seen before take their kept prefix (media rows included) and prefill only the text after it,
    # all in one chunk-prefill forward with a text-only prompt's tail (each row at its own rope delta: the
    # image prompt's is not 0), none one by one; each equals generate() and a full prefill's conditioning.
    runner = ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=6, max_seq_len=512, device="cpu",
                           dtype=torch.float32, prefix_cache_bytes=8 << 20)  # fmt: skip
    plain = _runner(hf_model, 0)
    user = lambda item, text: [SYSTEM, {"role": "user", "content": [item, {"type": "text", "text": text}]}]  # noqa: E731
    msgs = [user(_item("audio", 1), QUESTION), user(_item("image", 2), "And this?"),
            user(_clip(4), "Tell me what you hear in it, please."), [SYSTEM, {"role": "user", "content": QUESTION}]]
    inputs = [prepare_inputs(processor, m) for m in msgs]
    params = SamplingParams(max_tokens=REPLY)
    # first sightings: media prompts keep their blocks at once, text-only ones on their second sighting
    _run_together(runner, [running(f"a{i}", params, _prompt(x), slot=i) for i, x in enumerate(inputs + inputs[3:])])
    assert runner.media.rope_index(_prompt(inputs[1]))[1] != 0
    calls = []
    chunk_run = runner.chunk_prefill.run
    runner.chunk_prefill.run = lambda embeds, *a: calls.append(len(embeds)) or chunk_run(embeds, *a)
    runner.media_prefill.run = runner.long_prefill.run = runner.media.rows = None  # the media are in the cache
    hits_before = runner.prefix.hit_tokens
    seqs = [running(f"b{i}", params, _prompt(x), slot=5 - i) for i, x in enumerate(inputs)]
    for s in seqs:  # admission digests the media, so the step hashes nothing
        runner.validate(s)
    runner.media_prefix.salts = None
    got = _run_together(runner, seqs)
    assert calls == [len(inputs)]
    assert runner.prefix.hit_tokens - hits_before >= sum(x["input_ids"].shape[1] - BLOCK for x in inputs)
    for i, x in enumerate(inputs):
        want = oracle.generate(hf_model, x, REPLY, 2)[0]
        ref, _ = run_thinker(plain, running(f"p{i}", params, _prompt(x), slot=0))
        assert got[f"b{i}"].token_ids == want == ref.token_ids, i
        torch.testing.assert_close(got[f"b{i}"].talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[f"b{i}"].talker.special_rows, ref.talker.special_rows, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[f"b{i}"].text_rows, ref.text_rows, rtol=1e-4, atol=1e-5)
        plain.release(running(f"p{i}", params, _prompt(x), slot=0))


@pytest.mark.parametrize("joined", [True, False], ids=["in_the_decode_forward", "forward_of_its_own"])
@pytest.mark.parametrize("kind", ["audio", "image"])
def test_a_lone_media_prompt_beside_a_running_stream_rides_its_decode_and_matches_generate(kind, joined, hf_model,
                                                                                          processor):  # fmt: skip
    """A prompt with a clip or a picture arrives alone while a stream decodes, its system prompt kept, and
    takes a slot below the stream's that a finished request freed: its media go through the encoders and
    its rows after the kept prefix through the decode step's forward (one call of each layer's MLP), or,
    where no shape is captured beside the decode (LongPrefill.joins), through a forward of their own first.
    Either way its reply is generate()'s, and its K/V and talker conditioning are a full prefill's."""
    from .test_chunked_prefill import decode_forwards, serve

    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    for v in (1, 2):  # two sightings: the system prompt's blocks are kept
        seq = running(f"w{v}", SamplingParams(max_tokens=1), _prompt(prepare_inputs(processor, [SYSTEM, {
            "role": "user", "content": [_item(kind, v), {"type": "text", "text": "Hi"}]}])), slot=v - 1)  # fmt: skip
        run_thinker(cached, seq)
        cached.release(seq)
    if not joined:
        cached.long_prefill.joins = lambda *shape: False
    steps = decode_forwards(cached)
    inputs = {k: prepare_inputs(processor, [SYSTEM, {"role": "user", "content": c}]) for k, c in {
        "x": [{"type": "text", "text": "One more."}], "stream": [{"type": "text", "text": "Read this out."}],
        "media": [_item(kind, 3 if kind == "image" else 1), {"type": "text", "text": QUESTION}]}.items()}  # fmt: skip
    lengths = {"x": 1, "stream": 12, "media": REPLY}  # x (slot 0) ends at its prefill
    requests = {k: (k, SamplingParams(max_tokens=lengths[k], ignore_eos=True), _prompt(v)) for k, v in inputs.items()}
    got, log = serve(cached, 1024, [requests["x"], requests["stream"]], later=[requests["media"]])
    ridden = [(ids, mlp_calls) for ids, mlp_calls in steps if ids]
    assert [ids for ids, _ in ridden] == [["media"]] and got["media"].cached_tokens > 0
    assert cached.stats()["prompts_in_decode"] == (1 if joined else 0)
    assert len(ridden[0][1]) == (1 if joined else 2)
    for k, (_, params, _) in requests.items():
        assert got[k].token_ids == oracle.generate(hf_model, inputs[k], params.max_tokens, 2)[0], k
    prompt = requests["media"][2]
    ref = plain.prefill([running("ref", SamplingParams(max_tokens=REPLY), prompt, slot=3)])[0].output
    keys, values = log.kv["media"]
    torch.testing.assert_close(torch.cat(keys + values), slot_kv(plain.cache, 3, prompt.input_ids.numel()), rtol=1e-4,
                               atol=1e-5)  # fmt: skip
    torch.testing.assert_close(got["media"].talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)


def test_media_prompts_arriving_together_beside_a_stream_ride_its_decode_and_match_generate(hf_model, processor):
    """A clip's and a picture's prompts arrive together while a stream decodes, one in a slot below the
    stream's that a finished request freed: their media go through the encoders together and their rows
    after the kept prefix through the decode step's forward, a long-prefill row each (one call of each
    layer's MLP for the step), and each reply is generate()'s."""
    from .test_chunked_prefill import decode_forwards, serve

    cached = _runner(hf_model, 8 << 20)
    for v in (1, 2):  # two sightings: the system prompt's blocks are kept
        seq = running(f"w{v}", SamplingParams(max_tokens=1), _prompt(prepare_inputs(processor, [SYSTEM, {
            "role": "user", "content": [_item("audio", v), {"type": "text", "text": "Hi"}]}])), slot=v - 1)  # fmt: skip
        run_thinker(cached, seq)
        cached.release(seq)
    steps = decode_forwards(cached)
    inputs = {k: prepare_inputs(processor, [SYSTEM, {"role": "user", "content": c}]) for k, c in {
        "x": [{"type": "text", "text": "One more."}], "stream": [{"type": "text", "text": "Read this out."}],
        "audio": [_item("audio", 1), {"type": "text", "text": QUESTION}],
        "image": [_item("image", 3), {"type": "text", "text": QUESTION}]}.items()}  # fmt: skip
    lengths = {"x": 1, "stream": 12, "audio": REPLY, "image": REPLY}  # x (slot 0) ends at its prefill
    requests = {k: (k, SamplingParams(max_tokens=lengths[k], ignore_eos=True), _prompt(v)) for k, v in inputs.items()}
    got, _ = serve(cached, 1024, [requests["x"], requests["stream"]], later=[requests["audio"], requests["image"]])
    ridden = [(ids, mlp_calls) for ids, mlp_calls in steps if ids]
    assert sorted(i for ids, _ in ridden for i in ids) == ["audio", "image"]
    assert all(len(mlp_calls) == 1 for _, mlp_calls in ridden), ridden
    assert cached.stats()["prompts_in_decode"] == 2
    for k, (_, params, _) in requests.items():
        assert got[k].token_ids == oracle.generate(hf_model, inputs[k], params.max_tokens, 2)[0], k


@pytest.mark.gpu
@torch.inference_mode()
def test_media_prompts_riding_a_decode_on_cuda_equal_their_eager_prefill(tiny_checkpoint, processor):
    """As served on CUDA (bf16, the fused kernels, graphs captured): a clip's and a picture's prompts that ride
    a stream's decode step, a long-prefill row each, replay a graph captured beside it, and leave the K/V and
    the talker conditioning of an eager prefill of each, within bf16 rounding; the stream's decode row is the
    one it takes alone."""
    from .test_chunked_prefill import assert_close_in_bf16
    from .test_prefix_cache import cuda_runners

    graphs, eager = cuda_runners(tiny_checkpoint)

    def prompt(content):
        return _prompt(prepare_inputs(processor, [SYSTEM, {"role": "user", "content": content}]))

    for v in (1, 2):  # two sightings: the system prompt's blocks are kept
        warm = prompt([_item("audio", v), {"type": "text", "text": "Hi"}])
        seq = running(f"w{v}", SamplingParams(max_tokens=1), warm, slot=v - 1)
        graphs.prefill([seq])
        graphs.release(seq)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    stream = running("s", params, prompt([{"type": "text", "text": "Read this out."}]), 2)
    alone = running("s", params, stream.payload, 2)
    graphs.prefill([stream])
    eager.prefill([alone])
    items = {"audio": _item("audio", 1), "image": _item("image", 3)}
    riders = [running(k, SamplingParams(max_tokens=REPLY), prompt([item, {"type": "text", "text": QUESTION}]), slot=i)
              for i, (k, item) in enumerate(items.items())]  # fmt: skip
    assert graphs.riders(riders) == riders
    decoded, *ridden = graphs.decode([stream], riders)
    eager.decode([alone])  # the stream's row: the same logits in the joint forward as alone
    assert graphs.stats()["prompts_in_decode"] == 2 and decoded.seq is stream  # not a forward of their own
    assert_close_in_bf16(graphs.decoder.logits_out[2].float(), eager.decoder.logits_out[2].float())
    for seq, result in zip(riders, ridden):
        assert result.seq is seq and result.output.cached_tokens > 0
        ref = running(f"e{seq.request_id}", SamplingParams(max_tokens=REPLY), seq.payload, slot=3)
        [want] = eager.prefill([ref])
        n = seq.payload.input_ids.numel()
        assert_close_in_bf16(slot_kv(graphs.cache, seq.slot, n), slot_kv(eager.cache, 3, n))
        assert_close_in_bf16(result.output.talker.media_rows, want.output.talker.media_rows)
        eager.release(ref)
