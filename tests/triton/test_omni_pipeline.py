# The whole pipeline on a real tritonserver with the tiny checkpoint: what it serves equals
# transformers' generate(), concurrency does not change results, audio streams while the thinker is
# still talking, a disconnect frees every stage, text-only requests skip the talker, bad input is a 400.
import queue
import re
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.processor import prepare_inputs

from .. import oracle
from .conftest import RepoSpec
from .omni_client import OmniStream, omni

REPLY, FRAMES = 6, 40
GREEDY = {"temperature": "0", "talker_temperature": "0", "talker_repetition_penalty": "1.05"}


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    spec = default_spec(str(tiny_checkpoint), "cpu")
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository")


def gauge(metrics: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


def wait_for(predicate, timeout=20.0, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def infer_count(client, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"]["success"].get("count", 0)) + int(stats["inference_stats"]["fail"].get("count", 0))


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
def test_served_text_and_audio_equal_generate(kind, triton_server, hf_model, processor):
    msgs = oracle.messages(kind)
    want_text, want_codes, want_wav = oracle.generate(hf_model, prepare_inputs(processor, msgs), REPLY, FRAMES)
    r = omni(triton_server.grpc_url, msgs, dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES))
    assert r.error is None, r.error
    assert r.token_ids == want_text
    assert r.text == processor.tokenizer.decode(want_text, skip_special_tokens=True)
    assert r.finish_reason == "length"
    assert r.waveform.shape[0] == want_wav.shape[0] == want_codes.shape[0] * 1920 - 555
    assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4
    assert r.usage["completion_tokens"] == REPLY and r.usage["audio_frames"] == want_codes.shape[0]


def test_a_prompt_longer_than_the_static_prefill_is_served_in_chunks_as_generate(triton_server, hf_model, processor):
    """A ~700-token text prompt: thinker and talker prefill it in 512-token chunks (stages/long_prefill.py),
    and the served text and audio equal generate()'s."""
    msgs = oracle.messages("text", " ".join(f"word{i % 97} and" for i in range(170)))
    inputs = prepare_inputs(processor, msgs)
    assert 512 < inputs["input_ids"].shape[1] < 1024 - REPLY
    want_text, want_codes, want_wav = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    r = omni(triton_server.grpc_url, msgs, dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES))
    assert r.error is None, r.error
    assert r.token_ids == want_text and r.usage["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert r.usage["audio_frames"] == want_codes.shape[0]
    assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4


def test_first_chunks_take_code2wav_first_lane(triton_server, hf_model, processor):
    """A stream's first chunk goes through Code2Wav's first lane (its own worker; CUDA graphs on cuda), the
    later ones through the main worker, and the audio still equals generate()'s."""
    msgs = oracle.messages("text", "Say something short")
    _, _, want_wav = oracle.generate(hf_model, prepare_inputs(processor, msgs), REPLY, FRAMES)
    firsts = lambda: gauge(triton_server.metrics(), "omni_code2wav_first_chunks_total")  # noqa: E731
    chunks = lambda: gauge(triton_server.metrics(), "omni_code2wav_chunks_total")  # noqa: E731
    mains = lambda: gauge(triton_server.metrics(), "omni_code2wav_main_chunks_total")  # noqa: E731
    main_seconds = lambda: gauge(triton_server.metrics(), "omni_code2wav_main_chunk_seconds_total")  # noqa: E731
    first_before, chunks_before, mains_before, seconds_before = firsts(), chunks(), mains(), main_seconds()
    r = omni(triton_server.grpc_url, msgs, dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES))
    assert r.error is None, r.error
    assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4
    wait_for(lambda: chunks() >= chunks_before + 3, what="code2wav chunk counts")  # 4 + 25 + 11 frames
    assert firsts() == first_before + 1
    wait_for(lambda: mains() == mains_before + 2, what="the main lane's chunk count")  # the 25 and the 11
    assert main_seconds() > seconds_before
    assert gauge(triton_server.metrics(), "omni_code2wav_response_send_seconds_total") > 0


def test_one_frame_first_chunk_sent_with_the_talker_prefill(triton_launcher, tiny_checkpoint, hf_model, processor):
    """The cuda profile's chunk schedule (a first chunk of 1 frame, the one the talker completes in its
    prefill step, sent on the thinker's first reply row): the first audio is one frame and the whole still
    equals generate()'s."""
    spec = default_spec(str(tiny_checkpoint), "cpu")
    spec["omni_ensemble"].parameters["first_chunk_frames"] = spec["code2wav"].parameters["first_chunk_frames"] = "1"
    server = triton_launcher(RepoSpec(models=spec, src=REPO_ROOT / "model_repository"))
    msgs = oracle.messages("text", "Say something short")
    want_text, want_codes, want_wav = oracle.generate(hf_model, prepare_inputs(processor, msgs), REPLY, FRAMES)
    r = omni(server.grpc_url, msgs, dict(GREEDY, max_tokens=REPLY, talker_max_tokens=FRAMES))
    assert r.error is None, r.error
    assert r.token_ids == want_text
    assert r.waveform.shape[0] == want_wav.shape[0]
    assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4
    chunks = lambda: gauge(server.metrics(), "omni_code2wav_chunks_total")  # noqa: E731
    wait_for(lambda: chunks() >= 3, what="code2wav chunk counts")  # 1 + 25 + 14 frames
    assert gauge(server.metrics(), "omni_code2wav_first_chunks_total") == 1
    assert len(r.audio[0]) == 1920 - 555  # the first audio: one frame, less the vocoder's look-ahead


def _stage(url, model, inputs: dict, parameters: dict) -> list[dict]:
    out, error = _stage_stream(url, model, inputs, parameters)
    assert error is None, error
    return out


def _stage_stream(url, model, inputs: dict, parameters: dict) -> tuple[list[dict], str | None]:
    """A stage's responses to one request, up to its final one or its error (the error's message)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensors = []
    for name, value in inputs.items():
        value = np.ascontiguousarray(value)
        t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)
    client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
    out, message = [], None
    while True:
        result, error = responses.get(timeout=120)
        if error is not None:
            message = error.message()
            break
        response = result.get_response()
        out.append({o.name: result.as_numpy(o.name) for o in response.outputs})
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return out, message


def test_an_image_prompt_the_thinker_admits_aside_is_refused_or_served_on_its_stream(triton_server, processor):
    """An image prompt is validated on the thinker's intake threads (StageEngine.add_async): a placeholder
    count that differs from its image's tokens still comes back as the client's error on its own stream, and
    the prompt as the processor made it is served."""
    inputs = prepare_inputs(processor, oracle.messages("image"))
    good = {"input_ids": inputs["input_ids"][0].numpy(), "pixel_values": inputs["pixel_values"].numpy(),
            "image_grid_thw": inputs["image_grid_thw"].numpy().astype(np.int64)}  # fmt: skip
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    bad = dict(good, input_ids=np.append(good["input_ids"], image_token))
    params = {"max_tokens": 2, "temperature": "0"}
    out, error = _stage_stream(triton_server.grpc_url, "thinker", bad, params)
    assert error is not None and "placeholder" in error and not out, (out, error)
    out, error = _stage_stream(triton_server.grpc_url, "thinker", good, params)
    assert error is None and sum(len(r["token_ids"]) for r in out if r.get("token_ids") is not None) == 2


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
def test_stage_models_serve_generates_codec_codes(kind, triton_server, hf_model, processor):
    """Thinker and talker called directly through Triton, as a user of the stage models would."""
    inputs = prepare_inputs(processor, oracle.messages(kind))
    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    thinker_inputs = {"input_ids": inputs["input_ids"][0].numpy()}
    wire = {"pixel_values": np.uint8, "image_grid_thw": np.int64, "input_features": np.float32,
            "feature_attention_mask": np.int64}  # fmt: skip
    for name, dtype in wire.items():
        if name in inputs:
            thinker_inputs[name] = inputs[name].numpy().astype(dtype)
    thinker = _stage(triton_server.grpc_url, "thinker", thinker_inputs,
                     {"max_tokens": REPLY, "temperature": "0", "export_talker": True})  # fmt: skip
    tokens = [int(t) for r in thinker for t in (r.get("token_ids") if r.get("token_ids") is not None else [])]
    assert tokens == want_text
    first = thinker[0]
    rows = np.concatenate([r["text_rows"] for r in thinker if r.get("text_rows") is not None])
    talker_inputs = {k: first[k] for k in ("talker_media_rows", "talker_user_is_mm", "talker_user_ids",
                                           "talker_special_rows") if first.get(k) is not None}  # fmt: skip
    assert ("talker_media_rows" in talker_inputs) == (kind != "text")  # only a media prompt has rows to hand over
    talker_inputs["text_rows"] = rows
    if "image_grid_thw" in inputs:
        talker_inputs["image_grid_thw"] = inputs["image_grid_thw"].numpy().astype(np.int64)
    if "feature_attention_mask" in inputs:
        talker_inputs["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(-1).numpy().astype(np.int64)
    talker = _stage(triton_server.grpc_url, "talker", talker_inputs,
                    {"session": f"direct-{kind}", "text_end": True, "speaker": "Ethan", "max_tokens": FRAMES,
                     "temperature": "0", "repetition_penalty": "1.05"})  # fmt: skip
    codes = np.concatenate([r["codes"] for r in talker if r.get("codes") is not None])
    assert np.array_equal(codes, want_codes.numpy())


def test_concurrent_requests_match_each_alone(triton_server, processor):
    cases = [(f"Say hello {'!' * i}", 3 + 3 * i, 5 + 4 * i) for i in range(8)]
    params = [dict(GREEDY, max_tokens=reply, talker_max_tokens=frames) for _, reply, frames in cases]
    alone = [omni(triton_server.grpc_url, oracle.messages("text", text), p) for (text, _, _), p in zip(cases, params)]
    streams = [OmniStream(triton_server.grpc_url, oracle.messages("text", text), p) for (text, _, _), p in zip(cases, params)]
    together = [s.run() for s in streams]
    for a, b in zip(alone, together):
        assert a.error is None and b.error is None
        assert b.token_ids == a.token_ids
        assert b.waveform.shape == a.waveform.shape
        assert oracle.rel_error(torch.from_numpy(b.waveform), torch.from_numpy(a.waveform)) < 1e-4


def test_a_repeated_prompt_takes_its_prefix_from_the_thinkers_cache(triton_server):
    """From its third time on, a prompt's blocks come from the thinker's prefix cache (kept on their second
    sighting), with the same reply and audio; only the thinker exports the cache's counters."""
    params = dict(GREEDY, max_tokens=4, talker_max_tokens=6)
    messages = oracle.messages("text", "Read this sentence to me slowly, please, and clearly.")
    hits = lambda: gauge(triton_server.metrics(), "omni_thinker_prefix_cache_hit_tokens_total")
    before = hits()
    results = [omni(triton_server.grpc_url, messages, params) for _ in range(3)]
    assert all(r.error is None for r in results)
    assert results[2].token_ids == results[0].token_ids
    assert oracle.rel_error(torch.from_numpy(results[2].waveform), torch.from_numpy(results[0].waveform)) < 1e-4
    wait_for(lambda: hits() >= before + 16, what="prefix cache hits")  # metrics lag up to 0.25 s
    assert "omni_talker_prefix_cache" not in triton_server.metrics()


def test_a_long_chats_next_turn_takes_its_earlier_turn_from_the_cache(triton_server, hf_model, processor):
    """Prompts longer than a prefill chunk keep their blocks for the conversation's next turn, which prefills
    only what follows them and still gets generate()'s tokens."""
    words = lambda k: " ".join(f"word{(i * k) % 89} and" for i in range(150 if k == 3 else 50))
    user = lambda k: {"role": "user", "content": [{"type": "text", "text": words(k)}]}
    first = [oracle.SYSTEM, user(3)]
    second = first + [{"role": "assistant", "content": "Sure."}, user(5)]
    n = prepare_inputs(processor, first)["input_ids"].shape[1]
    assert n > 512  # a long prompt (stages/long_prefill.py's CHUNK_TOKENS)
    hits = lambda: gauge(triton_server.metrics(), "omni_thinker_prefix_cache_hit_tokens_total")
    params = dict(GREEDY, max_tokens=3, modalities="text")
    assert omni(triton_server.grpc_url, first, params).error is None
    time.sleep(0.5)  # metrics lag up to 0.25 s
    before = hits()
    r = omni(triton_server.grpc_url, second, params)
    assert r.error is None and r.token_ids == oracle.generate(hf_model, prepare_inputs(processor, second), 3, 2)[0]
    wait_for(lambda: hits() >= before + (n - 1) // 16 * 16, what="the first turn's blocks taken")


def test_many_concurrent_requests_all_finish(triton_server):
    """More requests than Triton's default Python-backend BLS thread pool (32) can hold streams for: with
    that default the orchestrator deadlocked at 64 concurrent requests."""
    params = dict(GREEDY, max_tokens=4, ignore_eos=True, talker_max_tokens=8, talker_ignore_eos=True)
    streams = [OmniStream(triton_server.grpc_url, oracle.messages("text"), params) for _ in range(64)]
    results = [s.run(timeout=240) for s in streams]
    assert all(r.error is None and r.finish_reason == "length" for r in results)
    assert all(len(r.waveform) == 8 * 1920 - 555 for r in results)


def test_audio_streams_before_the_thinker_finishes(triton_server):
    reply, frames = 200, 60
    r = omni(triton_server.grpc_url, oracle.messages("text"),
             dict(GREEDY, max_tokens=reply, ignore_eos=True, talker_max_tokens=frames, talker_ignore_eos=True))  # fmt: skip
    assert r.error is None and len(r.token_ids) == reply
    first_audio = next(t for t, kind in r.events if kind == "audio")
    last_text = max(t for t, kind in r.events if kind == "text")
    assert first_audio < last_text, r.events
    # chunk schedule: 4 frames first, then 25; each chunk's samples are final (the 555-sample tail waits)
    sizes = [len(a) for a in r.audio]
    assert sizes == [4 * 1920 - 555, 25 * 1920, 25 * 1920, 6 * 1920]
    assert sum(sizes) == frames * 1920 - 555


def test_disconnect_frees_slots_in_every_stage(triton_server):
    # long enough that neither stage could finish on its own within the wait below
    params = dict(GREEDY, max_tokens=900, ignore_eos=True, talker_max_tokens=500, talker_ignore_eos=True)
    steps_before = gauge(triton_server.metrics(), "omni_thinker_steps_total")
    stream = OmniStream(triton_server.grpc_url, oracle.messages("text"), params)
    while not stream.result.audio:
        assert stream.next(timeout=60), stream.result.error
    # the gauges are sampled every 0.25 s by a thread that competes for the GIL: wait for a sample that saw it
    def held_slots():
        metrics = triton_server.metrics()
        return gauge(metrics, "omni_thinker_slots_in_use") + gauge(metrics, "omni_talker_slots_in_use")

    code2wav_sessions = lambda: gauge(triton_server.metrics(), "omni_code2wav_sessions")  # noqa: E731
    wait_for(lambda: held_slots() >= 1 and code2wav_sessions() >= 1, what="a held slot and a code2wav session")
    stream.cancel()
    for stage in ("thinker", "talker"):
        wait_for(lambda: gauge(triton_server.metrics(), f"omni_{stage}_slots_in_use") == 0, what=f"{stage} slots")
    wait_for(lambda: code2wav_sessions() == 0, what="the code2wav session (its state) freed")
    # freed by the abort, not by running out: 900 tokens take at least 900 thinker steps
    time.sleep(0.5)
    assert gauge(triton_server.metrics(), "omni_thinker_steps_total") - steps_before < 850
    # and the server still serves
    assert omni(triton_server.grpc_url, oracle.messages("text"), dict(GREEDY, max_tokens=2, modalities="text")).error is None


def test_text_only_never_touches_talker_or_code2wav(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    before = {m: infer_count(client, m) for m in ("thinker", "talker", "code2wav")}
    r = omni(triton_server.grpc_url, oracle.messages("text"), dict(GREEDY, max_tokens=5, modalities="text"))
    assert r.error is None and len(r.token_ids) == 5 and r.audio == []
    after = {m: infer_count(client, m) for m in ("thinker", "talker", "code2wav")}
    assert after["thinker"] > before["thinker"]
    assert after["talker"] == before["talker"] and after["code2wav"] == before["code2wav"]
    client.close()


@pytest.mark.parametrize("messages, parameters, message", [
    ("not json", {}, "not valid JSON"),
    ([], {}, "non-empty"),
    ([{"role": "user", "content": "hi"}], {"modalities": "video"}, "modalities"),
    ([{"role": "user", "content": "hi"}], {"speaker": "nobody"}, "param=speaker code=invalid_voice] unknown voice"),
    ([{"role": "user", "content": "hi"}], {"max_tokens": "-3"}, "max_tokens"),
    # vLLM's rule: only prompt + max_tokens beyond the thinker's context (1024 here) is refused, naming both
    ([{"role": "user", "content": "hi"}], {"max_tokens": "100000"}, "param=max_tokens code=context_length_exceeded"),
    ([{"role": "user", "content": "hi"}], {"temperature": "hot"}, "temperature"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]}], {}, ""),
    ([{"role": "wizard", "content": "hi"}], {}, ""),
])  # fmt: skip
def test_bad_input_is_a_400_and_nothing_breaks(triton_server, messages, parameters, message):
    if isinstance(messages, str):  # raw, not JSON-encoded by the helper
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        inp = grpcclient.InferInput("messages", [1], "BYTES")
        inp.set_data_from_numpy(np.array([messages.encode()], dtype=np.object_))
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("omni_ensemble", [inp], parameters=parameters)
        _, error = responses.get(timeout=60)
        client.stop_stream()
        client.close()
        error = str(error)
    else:
        error = omni(triton_server.grpc_url, messages, parameters).error
    assert error is not None and "[400" in error and message in error, error
    assert omni(triton_server.grpc_url, oracle.messages("text"), dict(GREEDY, max_tokens=2, modalities="text")).error is None


def test_code2wav_turns_away_a_bad_chunk_alone(triton_server):
    """Streams called directly: a chunk with out-of-range codes gets its own 400 and opens nothing; the
    others get their audio, each stream's chunks decoded from the state the stage keeps for its session."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    rng = np.random.default_rng(0)
    good = rng.integers(0, 2048, size=(12, 16), dtype=np.int64)

    def send(session, codes, action, end, request_id):
        t = grpcclient.InferInput("codes", list(codes.shape), "INT64")
        t.set_data_from_numpy(codes)
        client.async_stream_infer("code2wav", [t], request_id=request_id,
                                  parameters={"session": session, "action": action, "end": end})  # fmt: skip

    def answers(n):
        audio, errors = {}, {}
        for _ in range(n):
            result, error = responses.get(timeout=120)
            if error is not None:
                errors[str(error)] = error
            else:
                audio[result.get_response().id] = result.as_numpy("audio")
        return audio, errors

    for i in range(4):
        send(f"direct-c{i}", good[:6], "start", False, f"c{i}")
    send("direct-bad", np.full((6, 16), 4096, dtype=np.int64), "start", False, "bad")
    first, errors = answers(5)
    assert len(errors) == 1 and sorted(first) == [f"c{i}" for i in range(4)], (list(errors), sorted(first))
    message = next(iter(errors))
    assert "[400]" in message and "codes must be in [0, 2048)" in message and "4096" in message, message
    for i in range(4):
        send(f"direct-c{i}", good[6:], "append", True, f"c{i}")
    send("direct-bad", good[6:], "append", True, "bad")  # its start was refused: no session to append to
    second, errors = answers(5)
    client.stop_stream()
    client.close()
    message = next(iter(errors))
    assert len(errors) == 1 and "[400]" in message and "no open code2wav session" in message, message
    assert all(a.shape == (6 * 1920 - 555,) for a in first.values())
    assert all(a.shape == (6 * 1920,) for a in second.values())
    for i in range(4):  # same codes, same audio, batched or not
        assert np.allclose(first[f"c{i}"], first["c0"], atol=1e-5) and np.allclose(second[f"c{i}"], second["c0"], atol=1e-5)
    wait_for(lambda: gauge(triton_server.metrics(), "omni_code2wav_sessions") == 0, what="sessions closed by their end")
