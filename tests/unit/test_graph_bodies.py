# Every CUDA-graph body of the stages, driven on the tiny checkpoint on the CPU under tests/graph_guard.py:
# none may sync the host with the device, make a shape from device values or bring host data in, since a
# capture that does fails on the GPU. The models are loaded as the CUDA stages load them (our experts
# implementation) and the runners built with cuda_graphs on, so they take the graph paths (static code
# predictor, block tables of whole chunks); off CUDA the banks run their bodies eagerly, at exact sizes.
import numpy as np
import pytest
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.models import experts
from omnistage.models.checkpoint import load_config, load_stage
from omnistage.models.processor import prepare_inputs
from omnistage.stages.code2wav import Code2WavRunner
from omnistage.stages.code2wav_first import FirstChunkDecoder
from omnistage.stages.code2wav_later import LaterChunkDecoder
from omnistage.stages.cuda_graphs import GraphBank
from omnistage.stages.long_prefill import CHUNK_TOKENS
from omnistage.stages.static_decode import StaticDecoder
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from ..graph_guard import GraphCaptureError, graph_capture_guard, guard_graph_bodies
from ..video_clips import make_video
from .test_media_prefix import QUESTION, SYSTEM, _clip, _prompt
from .test_stage_oracle import run_talker, run_thinker, running
from .test_video import _messages as _video_messages, _thinker_prompt as _video_prompt

RUNNER = dict(max_slots=4, max_seq_len=2048, device="cpu", dtype=torch.float32, cuda_graphs=True)
REPLY, FRAMES = 3, 3


@pytest.fixture(scope="module", autouse=True)
def bodies():
    """(bank name, key) of every body run in the module, each under the guard."""
    with pytest.MonkeyPatch.context() as mp:
        ran = guard_graph_bodies(mp)
        yield ran


@pytest.fixture(scope="module")
def stages(tiny_checkpoint):
    load = lambda stage: load_stage(tiny_checkpoint, stage, torch.float32, "cpu",  # noqa: E731
                                    experts_implementation=experts.NAME)  # fmt: skip
    return load_config(tiny_checkpoint), load("thinker"), load("talker")


@pytest.fixture
def thinker(stages):
    config, model, _ = stages
    return ThinkerRunner(model, config, prefix_cache_bytes=8 << 20, **RUNNER)


@pytest.fixture
def talker(stages):
    config, thinker_model, model = stages
    return TalkerRunner(model, config, thinker_model.get_input_embeddings().weight, **RUNNER)


def ran_since(bodies, start: int) -> set:
    """The banks (name, key length) whose bodies ran after bodies[start]."""
    return {(name, len(key)) for name, key in bodies[start:]}


def text_prompt(processor, text: str, system=oracle.SYSTEM) -> ThinkerPrompt:
    inputs = prepare_inputs(processor, [system, {"role": "user", "content": text}])
    return ThinkerPrompt(inputs["input_ids"][0], export_talker=True)


# ---- the guard itself -----------------------------------------------------------------------------------
SYNCS = {
    "item": lambda x: x[0].item(),
    "bool": lambda x: bool(x[0] > 0),
    "int": lambda x: int(x[1]),
    "tolist": lambda x: x.tolist(),
    "cpu": lambda x: x.cpu(),
    "equal": lambda x: torch.equal(x, x),
    "mask index": lambda x: x[x > 2],
    "mask assign": lambda x: x.clone().masked_fill_(x > 2, 0).__setitem__(x > 3, 1.0),
    "nonzero": lambda x: torch.nonzero(x),
    "where(cond)": lambda x: torch.where(x > 2),
    "unique": lambda x: torch.unique(x),
    "repeat_interleave by tensor": lambda x: x.repeat_interleave(x.long()),
    "host data": lambda x: x + torch.tensor([1.0, 2, 3, 4, 5, 6]),
    "factory without device": lambda x: x + torch.arange(6),
    "list index": lambda x: x[[0, 2]],
    "tensor slice bound": lambda x: x[: x.long()[2]],
    "histc without range": lambda x: torch.histc(x, bins=4),
}
ALLOWED = {
    "factory with device": lambda x: x + torch.arange(6, device=x.device),
    "like": lambda x: torch.zeros_like(x) + x.new_ones(6),
    "repeat_interleave by int": lambda x: x.repeat_interleave(2, dim=0),
    "long index": lambda x: x[torch.arange(3, device=x.device)],
    "masked_fill / where": lambda x: torch.where(x > 2, x, 0.0).masked_fill(x > 4, 1.0),
    "histc with range": lambda x: torch.histc(x, bins=4, min=0, max=5),
    "shapes": lambda x: x.view(int(x.shape[0]) // 2, 2)[: x.shape[0] // 3],
}


@pytest.mark.parametrize("name", SYNCS)
def test_the_guard_fails_what_capture_cannot_record(name):
    x = torch.arange(6.0)
    SYNCS[name](x)  # fine outside a body
    with pytest.raises(GraphCaptureError), graph_capture_guard():
        SYNCS[name](x)


def test_the_guard_fails_a_pinned_allocation():
    with pytest.raises(GraphCaptureError), graph_capture_guard():  # raised before torch looks for a CUDA host
        torch.empty(6, pin_memory=True, device="cpu")


@pytest.mark.parametrize("name", ALLOWED)
def test_the_guard_lets_device_work_through(name):
    x = torch.arange(6.0)
    with graph_capture_guard():
        ALLOWED[name](x)


def test_a_sync_injected_into_a_decode_body_fails_the_step(thinker, processor, monkeypatch):
    """The thinker's decode step with an .item() added to its body: the guarded bank raises."""
    seq = running("t", SamplingParams(max_tokens=4, ignore_eos=True), text_prompt(processor, "Hi!"), slot=0)
    thinker.prefill([seq])
    body = StaticDecoder._run
    monkeypatch.setattr(StaticDecoder, "_run", lambda self, *key: body(self, *key) or self.hidden_out[0, 0].item())
    with pytest.raises(GraphCaptureError, match="item"):
        thinker.decode([seq])


def test_a_bank_runs_its_body_under_the_guard():
    bank = GraphBank("probe", torch.device("cpu"), enabled=False)
    with pytest.raises(GraphCaptureError):
        bank.run(1, lambda: torch.ones(2).nonzero())


# ---- thinker --------------------------------------------------------------------------------------------
@torch.inference_mode()
def test_thinker_static_prefill_and_decode_of_mixed_lengths(thinker, processor, bodies):
    start = len(bodies)
    params = SamplingParams(max_tokens=REPLY, ignore_eos=True)
    short = running("s", params, text_prompt(processor, "Hi!"), slot=0)
    long = running("l", params, text_prompt(processor, "Please read this much longer sentence aloud, slowly."), 2)
    thinker.prefill([short, long])  # slot 1 free: the decode step covers it as a row that is not stepping
    for _ in range(REPLY - 1):
        thinker.decode([short, long])
    assert ran_since(bodies, start) == {("thinker_prefill", 2), ("thinker", 2)}


@torch.inference_mode()
def test_thinker_chunk_prefill_after_a_kept_prefix(thinker, processor, bodies):
    system = {"role": "system", "content": "You read the user's message aloud, word for word. " * 3}
    for i, text in enumerate(["One.", "Two."]):  # text-only blocks are kept on their second sighting
        seq = running(f"w{i}", SamplingParams(max_tokens=1), text_prompt(processor, text, system), slot=i)
        run_thinker(thinker, seq)
        thinker.release(seq)
    start = len(bodies)
    seqs = [running(f"c{i}", SamplingParams(max_tokens=REPLY, ignore_eos=True), text_prompt(processor, t, system), i)
            for i, t in enumerate(["Please say hello to everyone.", "Hi."])]  # fmt: skip
    thinker.prefill(seqs)
    thinker.decode(seqs)
    assert thinker.prefix.hit_tokens > 0
    assert ("thinker_chunk_prefill", 3) in ran_since(bodies, start)


@torch.inference_mode()
def test_long_prefills_of_thinker_and_talker(thinker, talker, processor, bodies):
    start = len(bodies)
    prompt = text_prompt(processor, " ".join(f"word{i % 97} and" for i in range(300)))
    assert 2 * CHUNK_TOKENS < prompt.input_ids.numel() < 3 * CHUNK_TOKENS
    out, _ = run_thinker(thinker, running("long", SamplingParams(max_tokens=REPLY, ignore_eos=True), prompt, slot=1))
    assert ran_since(bodies, start) == {("thinker_long_chunk_prefill", 3), ("thinker", 2)}
    start = len(bodies)
    spoken = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True)
    run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES), spoken, slot=0))
    assert ("talker_long_chunk_prefill", 3) in ran_since(bodies, start)


def _audio_and_image(processor, text="What do you hear and see?"):
    content = [_clip(3), {"type": "image_url", "image_url": {"url": oracle.png_data_url()}}, {"type": "text", "text": text}]
    return prepare_inputs(processor, [SYSTEM, {"role": "user", "content": content}])


@torch.inference_mode()
def test_thinker_media_prefill_of_audio_and_image_beside_text(thinker, processor, bodies):
    start = len(bodies)
    params = SamplingParams(max_tokens=REPLY, ignore_eos=True)
    seqs = [running("m", params, _prompt(_audio_and_image(processor)), slot=0),
            running("t", params, text_prompt(processor, "Say something kind."), slot=1)]  # fmt: skip
    thinker.prefill(seqs)
    thinker.decode(seqs)
    assert ran_since(bodies, start) == {("thinker_media_prefill", 2), ("thinker", 2)}


@torch.inference_mode()
def test_thinker_media_prefill_after_a_kept_prefix(thinker, processor, bodies):
    def user(seed: int):
        content = [_clip(seed), {"type": "text", "text": QUESTION}]
        return _prompt(prepare_inputs(processor, [SYSTEM, {"role": "user", "content": content}]))

    first = running("a", SamplingParams(max_tokens=1), user(1), slot=0)
    run_thinker(thinker, first)  # media prompts keep their blocks at once
    start = len(bodies)
    run_thinker(thinker, running("b", SamplingParams(max_tokens=REPLY, ignore_eos=True), user(2), slot=1))
    assert thinker.prefix.hit_tokens > 0
    assert ("thinker_media_prefill", 3) in ran_since(bodies, start)


@torch.inference_mode()
def test_video_prompts_through_the_media_and_long_prefills(thinker, talker, processor, bodies):
    """A short video with its audio track (deepstack rows, interleaved track rows) in one media prefill; a
    longer one, past the media buffers, in chunk rows that carry its media rows; its talker prompt too."""
    params = SamplingParams(max_tokens=REPLY, ignore_eos=True)
    for seconds, bank in ((2.0, ("thinker_media_prefill", 2)), (4.0, ("thinker_long_chunk_prefill", 3))):
        inputs = prepare_inputs(processor, _video_messages(make_video(seconds=seconds, fps=10, width=96, height=64,
                                                                      audio=True, seed=3)), use_audio_in_video=True)  # fmt: skip
        start = len(bodies)
        out, _ = run_thinker(thinker, running(f"v{seconds}", params, _video_prompt(inputs, True), slot=0))
        assert bank in ran_since(bodies, start)
        thinker.release(running(f"v{seconds}", params, _video_prompt(inputs, True), slot=0))
    start = len(bodies)
    spoken = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, None,
                          inputs["feature_attention_mask"].sum(-1), inputs["video_grid_thw"],
                          inputs["video_second_per_grid"])  # fmt: skip
    run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES), spoken, slot=3))
    assert ("talker_long_chunk_prefill", 3) in ran_since(bodies, start)


# ---- talker and code predictor --------------------------------------------------------------------------
def _talker_prompt(thinker, processor, inputs) -> TalkerPrompt:
    out, _ = run_thinker(thinker, running("t", SamplingParams(max_tokens=REPLY, ignore_eos=True), _prompt(inputs), 0))
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    return TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, inputs.get("image_grid_thw"), lengths)


@torch.inference_mode()
@pytest.mark.parametrize("temperature", [0.0, 0.9])  # greedy, and sampled residual codebooks
def test_talker_static_prefill_decode_and_code_predictor(thinker, talker, processor, bodies, temperature):
    prompt = _talker_prompt(thinker, processor, prepare_inputs(processor, oracle.messages("text")))
    start = len(bodies)
    run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES, temperature=temperature), prompt, slot=1))
    assert ran_since(bodies, start) == {("talker_prefill", 2), ("talker", 2), ("code_predictor", 2)}
    assert ("code_predictor", (1, temperature > 0)) in bodies[start:]  # the sampling kernels' body too


@torch.inference_mode()
def test_talker_media_prefill(thinker, talker, processor, bodies):
    prompt = _talker_prompt(thinker, processor, _audio_and_image(processor))
    start = len(bodies)
    run_talker(talker, running("a", SamplingParams(max_tokens=FRAMES), prompt, slot=2))
    assert ("talker_media_prefill", 2) in ran_since(bodies, start)


# ---- Code2Wav -------------------------------------------------------------------------------------------
def test_code2wav_first_and_later_chunk_decoders(tiny_checkpoint, bodies):
    runner = Code2WavRunner(load_stage(tiny_checkpoint, "code2wav", torch.float32, "cpu"), "cpu", torch.float32)
    first = FirstChunkDecoder(runner, frames=4, max_batch=4, cuda_graphs=True)
    later = LaterChunkDecoder(runner, chunk_frames=6, max_batch=4, cuda_graphs=True)
    rng = np.random.default_rng(0)
    streams = [torch.from_numpy(rng.integers(0, 2048, (20, 16))) for _ in range(3)]
    start = len(bodies)
    states = [state for _, state in first.decode([(codes[:4], None) for codes in streams])]
    for n in (6, 3):  # streams at different positions in one replay, a chunk padded to a frames bucket
        at = [s.position for s in states]
        sizes = [n, n - 1, 2]
        states = [state for _, state in later.decode([(codes[p : p + k], s)
                                                      for codes, p, k, s in zip(streams, at, sizes, states)])]  # fmt: skip
    assert ran_since(bodies, start) == {("code2wav-first4", 1), ("code2wav-later", 2)}
