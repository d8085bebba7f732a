# Stage replicas from a deploy profile on a real tritonserver (CPU, tiny checkpoint): two thinkers, two
# talkers and two code2wavs (separate models, sessions pinned by omni_ensemble). Requests spread over the
# replicas, every talker and code2wav call of a request lands on its replica, outputs equal generate() (with
# the talker greedy by the profile's sampling default), a cancelled request frees its slots on the replica
# that held them, and omni_ensemble publishes its handoff / TTFP / RTF histograms. The talkers run with a
# KV pool of 2.5 sequences of max_seq_len.
import re
import time

import pytest
import torch

from omnistage.launch.profile import BASE_PROFILE, load_profile
from omnistage.launch.render import profile_spec
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.checkpoint import load_config
from omnistage.models.processor import prepare_inputs
from omnistage.core.block_pool import BLOCK
from omnistage.stages.kv_budget import kv_bytes_per_token

from .. import oracle
from .conftest import RepoSpec
from .omni_client import OmniStream
from .test_omni_pipeline import FRAMES, GREEDY, REPLY, gauge, infer_count, wait_for

REPLICAS = {"thinker": ["thinker", "thinker_1"], "talker": ["talker", "talker_1"], "code2wav": ["code2wav", "code2wav_1"]}
TALKER_POOL_TOKENS = 2560  # 2.5 sequences of the base profile's max_seq_len, 1024


def talker_kv_budget(tiny_checkpoint) -> int:
    text = load_config(tiny_checkpoint).talker_config.text_config
    return TALKER_POOL_TOKENS * kv_bytes_per_token(text, torch.float32)


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "replicas.yaml"
    # the talker's sampling default from the profile (greedy) replaces its built-in temperature 0.9; a
    # request alone on the server gets a 2-frame first chunk (a light-load schedule, chunks.light_*)
    path.write_text(f"base: {BASE_PROFILE}\nstages: {{thinker: {{replicas: 2}}, code2wav: {{replicas: 2}}, "
                    "talker: {replicas: 2, sampling: {temperature: 0}, "
                    f"kv_cache_bytes: {talker_kv_budget(tiny_checkpoint)}}}}}\n"
                    "chunks: {light_first_chunk_frames: 2}\n")  # fmt: skip
    spec = profile_spec(load_profile(path, "cpu"), str(tiny_checkpoint))
    assert spec["code2wav"].instances == spec["code2wav_1"].instances == 1
    # seven Python model processes load one after another on a 2-core machine
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository", ready_timeout_s=420)


def test_requests_spread_over_replicas_and_keep_their_talker(triton_server, hf_model, processor):
    msgs = oracle.messages("text")
    want_text, want_codes, want_wav = oracle.generate(hf_model, prepare_inputs(processor, msgs), REPLY, FRAMES)
    client = triton_server.grpc_client()
    models = [m for names in REPLICAS.values() for m in names]
    before = {m: infer_count(client, m) for m in models}
    # no talker_temperature: greedy only through the profile's sampling default, which the oracle checks
    params = {k: v for k, v in GREEDY.items() if k != "talker_temperature"}
    params.update(max_tokens=REPLY, talker_max_tokens=FRAMES)
    streams = [OmniStream(triton_server.grpc_url, msgs, params) for _ in range(4)]
    results = [s.run(timeout=240) for s in streams]
    for r in results:  # same as the single-instance oracle, whichever replicas served it
        assert r.error is None, r.error
        assert r.token_ids == want_text
        assert r.waveform.shape[0] == want_codes.shape[0] * 1920 - 555
        assert oracle.rel_error(torch.from_numpy(r.waveform), want_wav) < 1e-4
    placements = [r.usage["replicas"] for r in results]
    for stage, names in REPLICAS.items():
        assert sorted(p[stage] for p in placements) == sorted(names * 2), placements
    # Triton's own per-model counts: a thinker replica served one stream per request routed to it, and a
    # talker replica the start plus every append of each request routed to it, so no call went astray
    after = {m: infer_count(client, m) for m in models}
    for m in REPLICAS["thinker"]:
        assert after[m] - before[m] == sum(p["thinker"] == m for p in placements)
    for m in REPLICAS["talker"]:
        calls = [1 + r.usage["hops"].get("talker_append", {}).get("count", 0) for r in results]
        assert after[m] - before[m] == sum(c for c, p in zip(calls, placements) if p["talker"] == m)
    for m in REPLICAS["code2wav"]:  # every chunk of a stream reached the replica that holds its state
        calls = [r.usage["hops"]["code2wav"]["count"] for r in results]
        assert after[m] - before[m] == sum(c for c, p in zip(calls, placements) if p["code2wav"] == m)
    metrics = triton_server.metrics()
    for m in models:
        assert float(re.search(rf'^nv_inference_count{{model="{m}",version="1"}} (\S+)$', metrics, re.M)[1]) > 0


def test_kv_budget_sizes_the_talkers_pool(triton_server, tiny_checkpoint):
    metrics = triton_server.metrics()
    text = load_config(tiny_checkpoint).talker_config.text_config
    blocks = TALKER_POOL_TOKENS // BLOCK
    assert series(metrics, "omni_talker_kv_blocks_total") == [blocks] * 2  # one series per replica
    assert series(metrics, "omni_talker_kv_cache_bytes") == [(blocks + 1) * BLOCK * kv_bytes_per_token(text, torch.float32)] * 2
    assert series(metrics, "omni_talker_gpu_memory_peak_bytes") == [0, 0]  # CPU
    assert series(metrics, "omni_talker_kv_cache_slots") == series(metrics, "omni_thinker_kv_cache_slots") == [8, 8]
    # no budget: max_batch_size sequences of max_seq_len (1024 tokens: 64 blocks)
    assert series(metrics, "omni_thinker_kv_blocks_total") == [8 * 64] * 2


def test_cancel_frees_the_slots_of_the_replicas_that_held_them(triton_server):
    params = dict(GREEDY, max_tokens=400, ignore_eos=True, talker_max_tokens=400, talker_ignore_eos=True)
    streams = [OmniStream(triton_server.grpc_url, oracle.messages("text"), params) for _ in range(2)]
    for s in streams:  # both are talking: their talker sessions are pinned, one per replica
        while "audio" not in [kind for _, kind in s.result.events]:
            assert s.next(timeout=120)
    slots = lambda stage: gauge(triton_server.metrics(), f"omni_{stage}_slots_in_use")  # noqa: E731
    # the gauges are sampled a few times per second: wait for the sample that sees both sessions
    wait_for(lambda: slots("talker") == 2 and slots("thinker") == 2, timeout=10, what="both sessions in the gauges")
    for s in streams:
        s.cancel()
    sessions = lambda: gauge(triton_server.metrics(), "omni_code2wav_sessions")  # noqa: E731
    wait_for(lambda: slots("talker") == 0 and slots("thinker") == 0 and sessions() == 0, timeout=30,
             what="slots and code2wav sessions freed on every replica")  # fmt: skip
    time.sleep(0.5)  # and nothing is re-admitted afterwards
    assert slots("talker") == 0 and slots("thinker") == 0 and sessions() == 0
    # and their KV blocks: the talkers keep none (the thinkers' prefix caches keep prompt blocks)
    wait_for(lambda: series(triton_server.metrics(), "omni_talker_kv_blocks_used") == [0, 0], timeout=10,
             what="the talkers' KV blocks freed")  # fmt: skip


def series(metrics: str, name: str, **labels) -> list[float]:
    want = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    return [float(v) for v in re.findall(rf"^{name}{{{want}[^}}]*}} (\S+)$", metrics, re.M)]


def quiet(triton_server) -> bool:
    metrics = triton_server.metrics()
    return series(metrics, "omni_requests_in_flight") == [0] and sum(series(metrics, "omni_replica_sessions")) == 0


def test_orchestrator_publishes_handoff_ttfp_and_rtf(triton_server):
    wait_for(lambda: quiet(triton_server), timeout=60, what="earlier requests to finish")
    time.sleep(1.0)  # and their last observations to be published (every 0.25 s)
    before = triton_server.metrics()
    started = time.perf_counter()
    params = dict(GREEDY, max_tokens=REPLY, ignore_eos=True, talker_max_tokens=FRAMES, talker_ignore_eos=True)
    r = OmniStream(triton_server.grpc_url, oracle.messages("text"), params).run()
    elapsed = time.perf_counter() - started
    assert r.error is None, r.error
    chunks = len(r.audio)  # 40 frames, alone on the server: 2, then 25, then 13
    assert r.audio[0].shape[0] == 2 * 1920 - 555  # the light-load first chunk

    def grew(name, by, **labels):
        return sum(series(triton_server.metrics(), name, **labels)) - sum(series(before, name, **labels)) >= by

    # each model publishes on its own 0.25 s tick: wait for code2wav's, the thinker's and the talker's counts
    # too, not just the orchestrator's (the talker's last steps can land a tick after the request ended)
    wait_for(lambda: grew("omni_audio_rtf_count", 1) and grew("omni_code2wav_chunks_total", chunks)
             and grew("omni_thinker_decode_rows_total", REPLY - 1) and grew("omni_talker_decode_rows_total", FRAMES - 1)
             and quiet(triton_server), what="the RTF observation and the stages' counts")  # fmt: skip
    after = triton_server.metrics()
    delta = lambda name, **labels: sum(series(after, name, **labels)) - sum(series(before, name, **labels))  # noqa: E731
    assert delta("omni_audio_ttfp_seconds_count") == 1
    first_audio = next(t for t, kind in r.events if kind == "audio")
    assert 0 < delta("omni_audio_ttfp_seconds_sum") <= first_audio + 0.5
    audio_seconds = len(r.waveform) / 24000
    assert 0 < delta("omni_audio_rtf_sum") <= elapsed / audio_seconds + 0.1
    assert delta("omni_handoff_latency_seconds_count", hop="code2wav") == chunks == 3
    assert delta("omni_handoff_latency_seconds_count", hop="talker_append") == r.usage["hops"]["talker_append"]["count"]
    assert delta("omni_code2wav_chunks_total") == chunks  # summed over the code2wav replicas
    assert 1 <= delta("omni_code2wav_forwards_total") <= chunks  # 3 chunks of 3 shapes: 3 decodes of 1 forward
    assert 0 < delta("omni_code2wav_busy_seconds_total") < elapsed
    for stage in ("thinker", "talker"):  # busy time is within the request's time, on one of the two replicas
        assert 0 < delta(f"omni_{stage}_decode_seconds_total") + delta(f"omni_{stage}_prefill_seconds_total") < elapsed
        # the response thread's time: sending the stage's responses, and making their tensors
        assert 0 < delta(f"omni_{stage}_response_send_seconds_total") < elapsed
        assert 0 < delta(f"omni_{stage}_response_encode_seconds_total") < elapsed
    assert delta("omni_thinker_decode_rows_total") == REPLY - 1  # the first reply token comes from the prefill
    assert delta("omni_talker_decode_rows_total") >= FRAMES - 1
    # the request's own timeline: milestones in causal order, the orchestrator's first audio before the client's
    t = r.usage["timeline_ms"]
    order = ["preprocessed", "thinker_first_output", "talker_started", "talker_first_frames", "first_chunk_cut",
             "first_audio_sent"]
    assert [t[m] for m in order] == sorted(t[m] for m in order) and t["first_audio_sent"] <= t["end"], t
    assert t["thinker_done"] <= t["end"] and t["first_audio_sent"] / 1e3 <= first_audio
    # ...counted from the request's arrival, as the TTFP histogram is, and published per milestone
    assert t["first_audio_sent"] / 1e3 == pytest.approx(delta("omni_audio_ttfp_seconds_sum"), abs=0.02)
    for milestone, ms in t.items():
        assert delta("omni_milestone_seconds_count", milestone=milestone) == 1, milestone
        assert delta("omni_milestone_seconds_sum", milestone=milestone) == pytest.approx(ms / 1e3, abs=1e-3)
    sessions = series(after, "omni_replica_sessions")
    assert len(sessions) == 6 and sum(sessions) == 0  # 3 stages x 2 replicas, all sessions released
    assert series(after, "omni_requests_in_flight") == [0]
