# perf/code2wav_group_timing.py: the groups it times are the ones its header names, realtime sessions at
# the playback schedule's positions (several shapes, chunks of the schedule's sizes) and text-to-speech
# streams that started together (one shape of 25 frames).
import torch

from omnistage.core.chunking import ChunkSchedule
from omnistage.models.checkpoint import load_stage
from omnistage.stages.code2wav import Code2WavRunner, chunk_key
from perf import code2wav_group_timing


def _codes():
    g = torch.Generator().manual_seed(0)
    return lambda n: torch.randint(0, 2048, (n, 16), generator=g)


def test_the_timed_groups_are_realtime_positions_and_one_tts_shape(tiny_checkpoint):
    runner = Code2WavRunner(load_stage(tiny_checkpoint, "code2wav", torch.float32, "cpu"), "cpu", torch.float32)
    realtime = code2wav_group_timing.realtime_group(runner, 8, _codes())
    schedule = ChunkSchedule(first_chunk_frames=1).for_playback()
    emitted, sizes, positions = 0, [], []
    for _ in range(7):
        sizes.append(schedule.next_frames(emitted))
        positions.append(emitted)
        emitted += sizes[-1]
    # stream i has decoded i % 6 + 1 chunks of the schedule and holds the next one
    assert [s.position for _, s in realtime] == [positions[i % 6 + 1] for i in range(8)]
    assert [int(c.shape[0]) for c, _ in realtime] == [sizes[i % 6 + 1] for i in range(8)]
    assert len({chunk_key(*c) for c in realtime}) == 6
    tts = code2wav_group_timing.tts_group(runner, 5, _codes())
    assert len({chunk_key(*c) for c in tts}) == 1 and all(c.shape[0] == 25 and s.position == 1 for c, s in tts)
