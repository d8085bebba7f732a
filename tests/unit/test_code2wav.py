# Code2WavRunner on tiny random Code2Wavs: streamed with carried state == full decode at every schedule,
# batch invariance, input validation, bf16 state. The init is rescaled so that every path matters
# (default init gives ~1e-6 audio, layer scales 0.01, ConvNeXt gamma 1e-6 and near-uniform attention,
# under which a wrong rope position or a missing key would hide below tolerance).
import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.core.errors import BadRequestError
from omnistage.models.random_init import make_code2wav_audible_
from omnistage.models.tiny_config import tiny_config_dict
from omnistage.stages.code2wav_first import FirstChunkDecoder
from omnistage.stages.code2wav_later import LaterChunkDecoder, frames_buckets
from omnistage.stages.code2wav import Code2WavRunner, StreamState, chunk_key, native_cpu_convs, take_group

TOL = 1e-5


def build(seed=0, dtype=torch.float32, **overrides):
    config = Qwen3OmniMoeCode2WavConfig(**{**tiny_config_dict()["code2wav_config"], **overrides})
    torch.manual_seed(seed)
    module = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.float32).eval()
    make_code2wav_audible_(module, seed)
    return module.to(dtype)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_codes(frames, seed):
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def full_decode(streamer, codes):
    with torch.inference_mode(), native_cpu_convs():  # oneDNN would build conv primitives per length (slow)
        return streamer.module(codes.T[None].to(streamer.device))[0, 0].float()


def stream(streamer, codes, first, size):
    pieces, state, start = [], None, 0
    while start < codes.shape[0]:
        n = min(first if start == 0 else size, codes.shape[0] - start)
        [(audio, state)] = streamer.decode([(codes[start : start + n], state)])
        assert audio.shape == (streamer.output_samples(n, start),)
        assert state.position == start + n
        pieces.append(audio)
        start += n
    return torch.cat(pieces)


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def streamer():
    return Code2WavRunner(build(), "cpu", torch.float32)


@pytest.fixture(scope="module")
def deep():  # 3 layers, window 8: the K/V cache must carry reach across layers (3 * 7 frames); GQA
    module = build(seed=1, num_hidden_layers=3, sliding_window=8, num_key_value_heads=1)
    return Code2WavRunner(module, "cpu", torch.float32)


@pytest.fixture(scope="module")
def codes300():
    return random_codes(300, seed=2)


def test_geometry(streamer):
    assert (streamer.samples_per_frame, streamer.tail_samples) == (1920, 555)
    assert streamer.conv_reach == 10  # same conv stack as the full-size model
    assert streamer.context_frames == 11  # + 1 frame margin
    assert streamer.kv_frames == 71


def test_scaled_init_is_audible(streamer, codes300):
    peak = full_decode(streamer, codes300[:30]).abs().max().item()
    assert 0.05 < peak < 1


@pytest.mark.parametrize(
    "frames,first,size", [(150, 4, 25), (300, 4, 25), (150, 1, 1), (150, 7, 13), (300, 7, 13)]
)
def test_stream_equals_full(streamer, codes300, frames, first, size):
    codes = codes300[:frames]
    full = full_decode(streamer, codes)
    streamed = stream(streamer, codes, first, size)
    assert streamed.shape == full.shape == (frames * 1920 - 555,)
    assert rel_err(streamed, full) < TOL


@pytest.mark.parametrize("first,size", [(4, 25), (1, 1), (7, 13), (60, 60)])
def test_deep_small_window_equals_full(deep, first, size):
    assert deep.kv_frames == 7
    codes = random_codes(60, seed=3)
    full = full_decode(deep, codes)
    assert rel_err(stream(deep, codes, first, size), full) < TOL


def test_eager_attention_equals_full():
    module = build(seed=1, num_hidden_layers=2, sliding_window=8)
    module.set_attn_implementation("eager")
    eager = Code2WavRunner(module, "cpu", torch.float32)
    codes = random_codes(40, seed=4)
    assert rel_err(stream(eager, codes, 3, 5), full_decode(eager, codes)) < TOL


def test_derived_reach_is_exact(streamer, codes300):
    # Structural check, free of rounding: a NaN in frame 0 reaches sample R * spf - tail (so with R - 1 context
    # frames the first emitted sample would depend on the zero padding) and no sample from (R + 1) * spf - tail
    # on (so with R frames, shifted by one, it depends on real frames only).
    r, spf, tail = streamer.conv_reach, streamer.samples_per_frame, streamer.tail_samples
    hidden = torch.randn(1, r + 4, streamer.hidden_size)
    hidden[:, 0] = float("nan")
    with torch.inference_mode():
        wav = streamer.conv_stack(hidden)[0]
    assert wav[r * spf - tail].isnan() and not wav[(r + 1) * spf - tail :].isnan().any()
    # And numerically: streaming with exactly R context frames (no margin) equals the full decode.
    exact = Code2WavRunner(streamer.module, "cpu", torch.float32, context_frames=r)
    codes = codes300[:80]
    assert rel_err(stream(exact, codes, 4, 25), full_decode(exact, codes)) < TOL


def test_batched_equals_alone(deep):
    # Streams at different positions (W and C' still growing, then full) in one call, two sharing a shape.
    streams = [random_codes(40, seed=10 + s) for s in range(4)]
    prefix = [0, 5, 20, 20]
    states = []
    for codes, p in zip(streams, prefix):
        state = None
        if p:
            [(_, state)] = deep.decode([(codes[:p], None)])
        states.append(state)
    chunks = [(codes[p : p + n], state) for codes, p, state, n in zip(streams, prefix, states, [4, 6, 6, 6])]
    batched = deep.decode(chunks)
    for chunk, (audio, state) in zip(chunks, batched):
        [(audio1, state1)] = deep.decode([chunk])
        assert rel_err(audio, audio1) < TOL
        assert state.position == state1.position
        assert torch.allclose(state.kv, state1.kv, atol=1e-6) and torch.allclose(state.hidden, state1.hidden, atol=1e-6)
    assert [s.kv.shape[3] for _, s in batched] == [4, 7, 7, 7]
    assert [s.hidden.shape[0] for _, s in batched] == [4, 11, 11, 11]


def test_bad_inputs(deep):
    good = random_codes(3, seed=5)
    [(_, state)] = deep.decode([(good, None)])
    bad = [
        (good.float(), None, "integers"),
        (good[:, :15], None, "must be"),
        (good[:0], None, "frames >= 1"),
        (good.clone().fill_(2048), None, r"\[0, 2048\)"),
        (good.clone().fill_(-1), None, r"\[0, 2048\)"),
        ([[0] * 16], None, "tensor"),
        (good, "state", "StreamState"),
        (good, StreamState(state.kv, state.hidden, 4), "after 4 frames"),
        (good, StreamState(state.kv, state.hidden, -1), ">= 0"),
        (good, StreamState(state.kv, state.hidden, True), "int"),
        (good, StreamState(state.kv[:, :, :, :1], state.hidden, 3), "kv"),
        (good, StreamState(state.kv, state.hidden[:, :5], 3), "hidden"),
        (good, StreamState(state.kv.long(), state.hidden, 3), "float"),
    ]
    for codes, st, match in bad:
        with pytest.raises(BadRequestError, match=match):
            deep.decode([(good, None), (codes, st)])
    with pytest.raises(BadRequestError, match="chunk 1"):
        deep.decode([(good, None), (good.clone().fill_(2048), None)])


def test_bf16_state_resumes_exactly():
    """A bf16 stream's state stays in the module's dtype (the stage keeps it as decode() returns it), and a
    chunk decoded from it, or from a copy, is the same."""
    streamer = Code2WavRunner(build(seed=1, num_hidden_layers=2, sliding_window=8, dtype=torch.bfloat16),
                              "cpu", torch.bfloat16)
    codes = random_codes(30, seed=6)
    [(_, state)] = streamer.decode([(codes[:12], None)])
    assert state.kv.dtype == state.hidden.dtype == torch.bfloat16 and state.position == 12
    copy = StreamState(state.kv.clone(), state.hidden.clone(), 12)
    [(a, sa)], [(b, sb)] = (streamer.decode([(codes[12:], s)]) for s in (state, copy))
    assert torch.equal(a, b) and torch.equal(sa.kv, sb.kv) and torch.equal(sa.hidden, sb.hidden)


def test_decode_groups_answers_first_chunks_first(deep):
    codes = random_codes(40, seed=9)
    [(_, state)] = deep.decode([(codes[:8], None)])
    batch = [(codes[8:20], state), (codes[:4], None), (codes[8:20], state), (codes[:6], None)]
    groups = list(deep.decode_groups(batch))
    assert [sorted(i for i, _ in g) for g in groups] == [[1], [3], [0, 2]]  # new streams first, shorter first
    together = deep.decode(batch)
    for g in groups:
        for i, (audio, st) in g:
            assert torch.equal(audio, together[i][0]) and st.position == together[i][1].position


def test_take_group_picks_the_least_decoded_shape_oldest_first(deep):
    """The Code2Wav worker's order: one forward's group at a time, the lowest chunk_key first (new streams,
    then shorter chunks), oldest first up to the limit; what is left keeps its order."""
    codes = random_codes(40, seed=9)
    [(_, state)] = deep.decode([(codes[:8], None)])
    assert chunk_key(codes[:4], None) == (0, 4, 0)
    assert chunk_key(codes[8:20], state) == (state.kv.shape[3], 12, state.hidden.shape[0])
    queued = ["late-25", "first-4a", "late-12", "first-4b", "first-4c", "first-6"]
    chunks = {"late-25": (codes[8:33], state), "late-12": (codes[8:20], state), "first-4a": (codes[:4], None),
              "first-4b": (codes[4:8], None), "first-4c": (codes[:4], None), "first-6": (codes[:6], None)}
    key = lambda name: chunk_key(*chunks[name])  # noqa: E731
    group, rest = take_group(queued, key, limit=2)
    assert group == ["first-4a", "first-4b"] and rest == ["late-25", "late-12", "first-4c", "first-6"]
    group, rest = take_group(rest, key, limit=8)
    assert group == ["first-4c"] and rest == ["late-25", "late-12", "first-6"]
    assert take_group(rest, key, limit=8)[0] == ["first-6"]
    assert take_group(["late-25", "late-12"], key, limit=8) == (["late-12"], ["late-25"])


def test_first_chunk_decoder_equals_decode(deep):
    """New streams' first chunks through FirstChunkDecoder (static buffers, padded to a batch bucket: the
    code a CUDA graph replays) equal decode(): audio, state, and the chunk after, from that state."""
    streams = [random_codes(20, seed=30 + s) for s in range(3)]
    first = FirstChunkDecoder(deep, frames=2, max_batch=4, cuda_graphs=False)
    assert not first.fits([(streams[0][:3], None)]) and not first.fits([(streams[0][:2], None)] * 5)
    for count in (1, 3, 2):  # buckets 1, 4 (one padded row, stale from the call before), 2
        chunks = [(codes[:2], None) for codes in streams[:count]]
        assert first.fits(chunks)
        for (audio, state), codes in zip(first.decode(chunks), streams):
            [(audio1, state1)] = deep.decode([(codes[:2], None)])
            assert rel_err(audio, audio1) < TOL and state.position == state1.position == 2
            assert torch.allclose(state.kv, state1.kv, atol=1e-6) and torch.allclose(state.hidden, state1.hidden, atol=1e-6)
            [(after, _)], [(after1, _)] = (deep.decode([(codes[2:9], s)]) for s in (state, state1))
            assert rel_err(after, after1) < TOL


def _cuda_runner():
    module = build(seed=1, num_hidden_layers=3, sliding_window=8, num_key_value_heads=1, dtype=torch.bfloat16)
    return Code2WavRunner(module.cuda(), "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_first_chunk_graphs_equal_eager_on_cuda():
    runner = _cuda_runner()
    graphed = FirstChunkDecoder(runner, frames=2, max_batch=8, cuda_graphs=True)
    graphed.capture_all()
    assert len(graphed.graphs.graphs) == len(graphed.buckets)
    chunks = [(random_codes(2, seed=40 + s), None) for s in range(5)]
    for (audio, state), (audio1, state1) in zip(graphed.decode(chunks), runner.decode(chunks)):
        assert audio.device.type == "cuda" and rel_err(audio, audio1) < 2e-2
        assert torch.allclose(state.kv.float(), state1.kv.float(), atol=2e-2)


def _advance(runner, codes, schedule):
    """A stream's state after eager chunks of the given sizes."""
    state, start = None, 0
    for n in schedule:
        [(_, state)] = runner.decode([(codes[start : start + n], state)])
        start += n
    return state, start


def test_later_chunk_decoder_equals_decode(deep):
    """Chunks with carried state through LaterChunkDecoder (static buffers, K/V right-aligned and masked, new
    frames and conv rows padded: the code a CUDA graph replays) equal decode(), at positions below and
    beyond the K/V window (7) and the conv context (11), mixed in one batch, and the chunk after."""
    assert frames_buckets(25) == [5, 10, 15, 20, 25] and frames_buckets(6) == [2, 3, 4, 5, 6] and frames_buckets(1) == [1]
    later = LaterChunkDecoder(deep, chunk_frames=6, max_batch=2, cuda_graphs=False)
    assert (later.kv_rows, later.context) == (7, 11)
    streams = [random_codes(40, seed=50 + s) for s in range(4)]
    schedules = [[1], [3, 2], [4, 5, 6], [6, 6, 6, 6, 6]]  # positions 1, 5, 15, 30
    states = [_advance(deep, codes, schedule) for codes, schedule in zip(streams, schedules)]
    for sizes in ([6, 2, 1, 5], [3], [2, 6]):  # 2 forwards of 2 streams (frames padded 1 -> 2), then stale rows
        chunks = [(codes[pos : pos + n], state) for (state, pos), codes, n in zip(states, streams, sizes)]
        assert later.fits(chunks)
        forwards = deep.forwards
        got = later.decode(chunks)
        assert deep.forwards - forwards == -(-len(chunks) // 2)  # one per replay of at most max_batch streams
        want = deep.decode(chunks)
        for (audio, state), (audio1, state1), (codes, old) in zip(got, want, chunks):
            assert audio.shape == audio1.shape and rel_err(audio, audio1) < TOL
            assert state.position == state1.position and state.kv.shape == state1.kv.shape
            assert torch.allclose(state.kv, state1.kv, atol=1e-6) and torch.allclose(state.hidden, state1.hidden, atol=1e-6)
        assert not later.fits([(streams[0][:7], states[0][0])]) and not later.fits([(streams[0][:2], None)])


@pytest.mark.gpu
def test_later_chunk_graphs_equal_eager_on_cuda():
    runner = _cuda_runner()
    graphed = LaterChunkDecoder(runner, chunk_frames=6, max_batch=4, cuda_graphs=True)
    graphed.capture_all()
    assert len(graphed.graphs.graphs) == len(graphed.batch_buckets) * len(graphed.frames_buckets)
    streams = [random_codes(30, seed=60 + s) for s in range(5)]
    states = [_advance(runner, codes, [1 + s, 6, 6][: 1 + s % 3]) for s, codes in enumerate(streams)]
    chunks = [(codes[pos : pos + 2 + s], state) for s, ((state, pos), codes) in enumerate(zip(states, streams))]
    for (audio, state), (audio1, state1) in zip(graphed.decode(chunks), runner.decode(chunks)):
        assert audio.device.type == "cuda" and rel_err(audio, audio1) < 2e-2
        assert torch.allclose(state.kv.float(), state1.kv.float(), atol=2e-2)
