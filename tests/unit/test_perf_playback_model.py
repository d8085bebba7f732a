# The chunk schedules against perf/playback_model.py's model of one reply (talker frame times, Code2Wav
# latencies in series, playback from the first chunk): the playback schedule keeps the audio ahead of
# playback for every reply length in the stated envelope; the fixed schedule does not, even at its lightest.
import pytest

from omnistage.core.chunking import PLAYBACK_FIRST_FRAMES, ChunkSchedule
from perf.playback_model import RampRule, simulate

FIRST_CALL_MS = 20  # a first-lane Code2Wav call at its quickest: the later calls' excess over it is what hurts
# (talker ms per frame, later Code2Wav call ms): the talker at 2x real time (40 ms a frame; ~25 at 64
# realtime sessions on the H200) with later calls of up to 300 ms (170-200 measured there at 32-64
# sessions), or at 1.6x with calls of up to 250 ms
ENVELOPE = [(frame_ms, 300) for frame_ms in (10, 20, 30, 40)] + [(frame_ms, 250) for frame_ms in (45, 50)]


@pytest.mark.parametrize("frame_ms, call_ms", ENVELOPE)
def test_playback_schedule_never_underruns_in_the_envelope(frame_ms, call_ms):
    schedule = ChunkSchedule(4, 25).for_playback()
    for frames in range(1, 301):
        run = simulate(schedule, frames, frame_ms, FIRST_CALL_MS, call_ms)
        assert run.underruns == 0 and run.margin_ms >= 0, (frames, run)


def test_fixed_schedule_underruns_where_playback_does_not():
    fixed, playback = ChunkSchedule(4, 25), ChunkSchedule(4, 25).for_playback()
    for frame_ms, call_ms in ENVELOPE:
        run = simulate(fixed, 40, frame_ms, FIRST_CALL_MS, call_ms)
        assert run.underruns == 1 and run.gap_ms > 0
        assert simulate(playback, 40, frame_ms, FIRST_CALL_MS, call_ms).underruns == 0


def test_outside_the_envelope_the_model_reports_the_gaps():
    # Code2Wav calls longer than a 6-frame chunk plays: each chunk in series falls further behind
    run = simulate(ChunkSchedule(4, 25).for_playback(), 40, 25, FIRST_CALL_MS, 500)
    assert run.underruns >= 3 and run.margin_ms < 0
    # a talker slower than real time cannot be kept ahead of by any chunking
    assert simulate(ChunkSchedule(4, 25).for_playback(), 40, 100, FIRST_CALL_MS, 50).underruns > 0


def test_pipelined_calls_change_nothing_while_chunks_outlast_a_call():
    schedule = ChunkSchedule(4, 25).for_playback()
    for frame_ms, call_ms in ENVELOPE:
        for frames in (8, 40, 46, 120):
            alone, pipelined = (simulate(schedule, frames, frame_ms, FIRST_CALL_MS, call_ms, p) for p in (False, True))
            assert (alone.underruns, alone.margin_ms) == (pipelined.underruns, pipelined.margin_ms)


def test_model_timeline_of_a_small_reply():
    run = simulate(ChunkSchedule(4, 25).for_playback(), 16, 30, 20, 250)
    assert run.chunks == [6, 4, 6]
    # frames 6 at 180 ms -> back at 200; frames 10 at 300 -> 550; 16 at 480, after the second call: 550 -> 800
    assert (run.first_audio_ms, run.last_audio_ms) == (200, 800)
    assert run.margin_ms == min(200 + 480 - 550, 200 + 800 - 800)


def test_the_models_rule_form_is_the_schedules():
    # perf.playback_model --rules varies the constants of this form; at 4 frames and 3/5 it is the schedule
    rule = RampRule(first_chunk_frames=PLAYBACK_FIRST_FRAMES, min_frames=4, share=0.6)
    schedule = ChunkSchedule().for_playback()
    for frames in range(0, 201):
        assert simulate(rule, frames, 1, 0, 0).chunks == simulate(schedule, frames, 1, 0, 0).chunks
