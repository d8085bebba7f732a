# Prompts that bring new media after a kept prefix (a shared system prompt; a conversation whose new turn
# brings a new clip) on the tiny checkpoint: the kept blocks are loaded, only the rest runs, batched through
# the MediaPrefill (its encoders over the new items alone), and the reply tokens, the K/V and the talker's
# codec codes equal transformers' generate() on the whole prompt.
import pytest
import torch

from omnistage.core.prefix_index import BLOCK
from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerRunner

from .. import oracle
from .test_media_prefix import AUDIO_PAD, QUESTION, REPLY, SYSTEM, _clip, _item, _prompt, _run_together, _same_kv
from .test_stage_oracle import FRAMES, run_talker, run_thinker, running

KW = {"max_slots": 6, "max_seq_len": 512, "device": "cpu", "dtype": torch.float32}


@pytest.fixture
def runners(hf_model, monkeypatch):
    """A thinker with a prefix cache whose media prefills are recorded (each run's starts) and whose chunked
    path fails the test, a plain one (no cache: full prefills) and a talker."""
    cached = ThinkerRunner(hf_model.thinker, hf_model.config, prefix_cache_bytes=8 << 20, **KW)
    cached.media_runs = []
    run = cached.media_prefill.run

    def record(prompts, slots, starts):
        cached.media_runs.append(starts)
        return run(prompts, slots, starts)

    monkeypatch.setattr(cached.media_prefill, "run", record)
    monkeypatch.setattr(cached, "_long_pieces", lambda *a: pytest.fail("a media prompt prefilled in chunks"))
    plain = ThinkerRunner(hf_model.thinker, hf_model.config, **KW)
    return cached, plain, TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **KW)


def _codes(talker, out, inputs, slot: int) -> torch.Tensor:
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"), lengths)
    seq = running(f"a{slot}", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp, slot)
    codes, _ = run_talker(talker, seq)
    talker.release(seq)
    return codes


def _audio_items(ids: torch.Tensor) -> list[tuple[int, int]]:
    rows = (ids == AUDIO_PAD).nonzero().squeeze(1)
    breaks = (rows[1:] != rows[:-1] + 1).nonzero().squeeze(1)
    return list(zip(torch.cat([rows[:1], rows[breaks + 1]]).tolist(), torch.cat([rows[breaks], rows[-1:]]).tolist()))


def _check(hf_model, runners, inputs, slot: int, name: str):
    """One prompt through the cached runner equals generate() (tokens, codec codes) and a full prefill (K/V,
    the talker's conditioning); returns the prompt tokens its prefill took from the cache."""
    cached, plain, talker = runners
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    before = cached.prefix.hit_tokens
    params = SamplingParams(max_tokens=REPLY)
    got, _ = run_thinker(cached, running(f"c{name}", params, _prompt(inputs), slot=slot))
    hit = cached.prefix.hit_tokens - before
    ref, _ = run_thinker(plain, running(f"p{name}", params, _prompt(inputs), slot=slot))
    assert got.token_ids == want_text == ref.token_ids, name
    _same_kv(cached, plain, slot, inputs["input_ids"].shape[1])
    torch.testing.assert_close(got.talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.text_rows, ref.text_rows, rtol=1e-4, atol=1e-5)
    assert torch.equal(_codes(talker, got, inputs, slot), want_codes), name
    cached.release(running(f"c{name}", params, _prompt(inputs), slot=slot))
    plain.release(running(f"p{name}", params, _prompt(inputs), slot=slot))
    return hit


@torch.inference_mode()
def test_a_new_clip_after_a_seen_system_prompt_prefills_after_its_blocks(runners, hf_model, processor):
    cached = runners[0]

    def user(seed: int) -> list:
        return [SYSTEM, {"role": "user", "content": [_clip(seed), {"type": "text", "text": QUESTION}]}]

    _check(hf_model, runners, prepare_inputs(processor, user(1)), 0, "first")
    assert cached.media_runs == [[0]]  # a first sighting: nothing kept yet
    second = prepare_inputs(processor, user(2))
    hit = _check(hf_model, runners, second, 1, "second")
    [(clip_first, _)] = _audio_items(second["input_ids"][0])
    assert hit == clip_first // BLOCK * BLOCK > 0  # the system prompt's whole blocks, up to the new clip
    assert cached.media_runs[1] == [hit]  # the rest, clip included, batched after them


@torch.inference_mode()
def test_a_second_turn_with_a_new_clip_prefills_after_the_first_turn(runners, hf_model, processor):
    cached = runners[0]
    turn1 = [SYSTEM, {"role": "user", "content": [_clip(3), {"type": "text", "text": QUESTION}]}]
    turn2 = turn1 + [{"role": "assistant", "content": "A tone, quite loud."},
                     {"role": "user", "content": [_clip(5), {"type": "text", "text": "And this one?"}]}]  # fmt: skip
    first = prepare_inputs(processor, turn1)
    _check(hf_model, runners, first, 0, "turn1")
    second = prepare_inputs(processor, turn2)
    hit = _check(hf_model, runners, second, 1, "turn2")
    (_, clip1_last), (clip2_first, _) = _audio_items(second["input_ids"][0])
    # turn 1's prompt, its clip included, came from the cache; the new clip and what follows ran
    assert clip1_last < (first["input_ids"].shape[1] - 1) // BLOCK * BLOCK <= hit <= clip2_first
    assert cached.media_runs[1] == [hit]


@torch.inference_mode()
def test_a_step_batches_prompts_after_a_prefix_with_fresh_media_and_text(runners, hf_model, processor):
    # One step: a new clip after a seen system prompt, a fresh image prompt and a fresh text prompt in one
    # MediaPrefill forward; a text prompt whose kept prefix leaves only text in the ChunkPrefill. A prompt
    # prefilled in chunks fails the test (fixture).
    cached, plain, _ = runners
    user = lambda item, text: [SYSTEM, {"role": "user", "content": [item, {"type": "text", "text": text}]}]  # noqa: E731
    seen = [SYSTEM, {"role": "user", "content": QUESTION}]
    params = SamplingParams(max_tokens=REPLY)
    warm = [user(_clip(1), QUESTION), seen, seen]  # media blocks are kept at once, text-only ones when seen twice
    _run_together(cached, [running(f"w{i}", params, _prompt(prepare_inputs(processor, m)), slot=i)
                           for i, m in enumerate(warm)])  # fmt: skip
    image = {"role": "user", "content": [_item("image", 2), {"type": "text", "text": "And this?"}]}
    msgs = [user(_clip(6), "What do you hear?"), [image], [{"role": "user", "content": "Say something kind."}], seen]
    inputs = [prepare_inputs(processor, m) for m in msgs]
    chunk_rows = []
    chunk_run = cached.chunk_prefill.run
    cached.chunk_prefill.run = lambda embeds, *a: chunk_rows.append(len(embeds)) or chunk_run(embeds, *a)
    cached.media_runs.clear()
    got = _run_together(cached, [running(f"b{i}", params, _prompt(x), slot=i) for i, x in enumerate(inputs)])
    assert len(cached.media_runs) == 1 and len(cached.media_runs[0]) == 3 and chunk_rows == [1]
    starts = cached.media_runs[0]
    assert starts[0] > 0 and starts[1:] == [0, 0]
    for i, x in enumerate(inputs):
        want = oracle.generate(hf_model, x, REPLY, 2)[0]
        ref, _ = run_thinker(plain, running(f"p{i}", params, _prompt(x), slot=0))
        assert got[f"b{i}"].token_ids == want == ref.token_ids, i
        torch.testing.assert_close(got[f"b{i}"].talker.media_rows, ref.talker.media_rows, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[f"b{i}"].text_rows, ref.text_rows, rtol=1e-4, atol=1e-5)
        plain.release(running(f"p{i}", params, _prompt(x), slot=0))
