# The orchestration logic (OmniRequest) over in-process stage engines: text and audio equal generate(),
# the stream is chunked on the schedule and equals the full decode, concurrent requests do not change each other's
# results, text-only requests never reach the talker, and a cancelled request frees its slots.
import threading
import time

import pytest
import torch

from omnistage.core.chunking import ChunkSchedule
from omnistage.core.errors import BadRequestError
from omnistage.models.processor import prepare_inputs
from omnistage.pipeline.local_stages import LocalStages
from omnistage.pipeline.options import OmniOptions
from omnistage.pipeline.request import OmniRequest, thinker_inputs

from .. import oracle

SPEAKERS = {"chelsie", "ethan", "aiden"}
GREEDY = {"temperature": 0, "talker_temperature": 0, "talker_repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def stages(hf_model):
    s = LocalStages(hf_model.thinker, hf_model.talker, hf_model.code2wav, hf_model.config, slots=8, max_seq_len=512)
    yield s
    s.close()


class Recorder:
    def __init__(self):
        self.text, self.ids, self.audio, self.events = "", [], [], []
        self.finish, self.error, self.usage = None, None, None
        self.done = threading.Event()

    def __call__(self, output, finish_reason, error):
        if output is not None:
            self.text += output.text
            self.ids += output.token_ids
            if output.audio is not None:
                self.audio.append(output.audio)
                self.events.append("audio")
            if output.token_ids:
                self.events.append("text")
            self.usage = output.usage or self.usage
        if finish_reason or error:
            self.finish, self.error = finish_reason, error
            self.done.set()


def start(stages, processor, msgs, params, schedule=ChunkSchedule(4, 25), session="s"):
    rec = Recorder()
    options = OmniOptions.from_parameters(params, SPEAKERS)
    inputs = thinker_inputs(prepare_inputs(processor, msgs))
    request = OmniRequest(session, inputs, options, stages, processor.tokenizer, schedule, rec)
    thread = threading.Thread(target=request.run)
    thread.start()
    return request, rec, thread


def run(*args, **kwargs):
    request, rec, thread = start(*args, **kwargs)
    thread.join(120)
    assert rec.done.is_set() and rec.error is None, rec.error
    return rec


@pytest.mark.parametrize("kind, playback", [("text", False), ("audio", False), ("text", True)])
def test_stream_equals_generate_and_full_decode(kind, playback, stages, processor, hf_model):
    reply, frames = 8, 60
    msgs = oracle.messages(kind)
    want_text, want_codes, want_wav = oracle.generate(hf_model, prepare_inputs(processor, msgs), reply, frames)
    frames_made = want_codes.shape[0]  # random weights may emit codec EOS before the limit
    params = dict(GREEDY, max_tokens=reply, talker_max_tokens=frames)
    schedule = ChunkSchedule(4, 25).for_playback() if playback else ChunkSchedule(4, 25)
    rec = run(stages, processor, msgs, params, schedule=schedule)
    assert rec.ids == want_text and rec.finish == "length"
    assert rec.text == processor.tokenizer.decode(want_text, skip_special_tokens=True)
    audio = torch.cat(rec.audio)
    assert audio.numel() == want_wav.numel() == frames_made * 1920 - 555
    assert oracle.rel_error(audio, want_wav) < 1e-4
    if playback:  # chunks end at frames 6, 10, 16, 25, 40, 60 (the first 6, each later 3/5 of those before)
        ends = [e for e in (6, 10, 16, 25, 40) if e < frames_made] + [frames_made]
        chunk_frames = [b - a for a, b in zip([0] + ends, ends)]
    else:
        chunk_frames = [4] + [25] * ((frames_made - 4) // 25) + ([(frames_made - 4) % 25] if (frames_made - 4) % 25 else [])
    assert [a.numel() for a in rec.audio] == [n * 1920 - 555 * (i == 0) for i, n in enumerate(chunk_frames)]
    assert rec.usage["completion_tokens"] == reply and rec.usage["audio_frames"] == frames_made


def test_concurrent_requests_match_each_alone(stages, processor):
    cases = [(f"Say hello {'!' * i}", 3 + 2 * i, 5 + 3 * i) for i in range(8)]
    alone = []
    for i, (text, reply, frames) in enumerate(cases):
        params = dict(GREEDY, max_tokens=reply, talker_max_tokens=frames)
        rec = run(stages, processor, oracle.messages("text", text), params, session=f"alone-{i}")
        alone.append((rec.ids, torch.cat(rec.audio)))
    started = [
        start(stages, processor, oracle.messages("text", text), dict(GREEDY, max_tokens=reply, talker_max_tokens=frames),
              session=f"together-{i}")
        for i, (text, reply, frames) in enumerate(cases)
    ]  # fmt: skip
    for (_, rec, thread), (ids, audio) in zip(started, alone):
        thread.join(120)
        assert rec.error is None and rec.ids == ids
        together = torch.cat(rec.audio)
        assert together.numel() == audio.numel() and oracle.rel_error(together, audio) < 1e-4
    assert stages.engines["thinker"].scheduler.slots_in_use == 0
    assert stages.engines["talker"].scheduler.slots_in_use == 0


def test_text_only_never_reaches_the_talker(stages, processor):
    steps = stages.engines["talker"].steps
    rec = run(stages, processor, oracle.messages("text"), dict(GREEDY, max_tokens=5, modalities="text"))
    assert len(rec.ids) == 5 and rec.audio == []
    time.sleep(0.2)
    assert stages.engines["talker"].steps == steps


def test_cancel_frees_slots_in_every_stage(stages, processor):
    params = dict(GREEDY, max_tokens=400, talker_max_tokens=400, ignore_eos=True, talker_ignore_eos=True)
    request, rec, thread = start(stages, processor, oracle.messages("text"), params, session="cancel-me")
    deadline = time.time() + 60
    while not rec.audio and time.time() < deadline:
        time.sleep(0.02)
    assert rec.audio, "no audio before cancelling"
    assert stages.engines["talker"].scheduler.slots_in_use == 1
    request.cancel()
    thread.join(30)
    assert rec.finish == "abort"
    for stage in ("thinker", "talker"):
        assert stages.engines[stage].scheduler.slots_in_use == 0, stage


def test_chunk_schedule_parameter():
    assert OmniOptions.from_parameters({"chunk_schedule": "playback"}, SPEAKERS).playback
    assert not OmniOptions.from_parameters({"chunk_schedule": "fixed"}, SPEAKERS).playback
    assert not OmniOptions.from_parameters({}, SPEAKERS).playback
    with pytest.raises(BadRequestError) as e:
        OmniOptions.from_parameters({"chunk_schedule": "ramp"}, SPEAKERS)
    assert (e.value.param, e.value.error_code) == ("chunk_schedule", "invalid_value")
