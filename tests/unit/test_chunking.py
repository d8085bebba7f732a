import itertools

import pytest

from omnistage.core.chunking import ChunkCutter, ChunkPolicy, ChunkSchedule, Window


def cut(schedule, pushes):
    """Windows per push() call plus finish(), for a list of frame counts."""
    cutter = schedule.cutter()
    return [cutter.push(n) for n in pushes], cutter.finish()


def all_windows(schedule, total, step=1):
    pushed, final = cut(schedule, [step] * (total // step) + ([total % step] if total % step else []))
    return [w for ws in pushed for w in ws] + final


def assert_covers(windows, total):
    if not windows:
        assert total == 0
        return
    assert [w.start for w in windows] == [0] + [w.end for w in windows[:-1]]
    assert windows[-1].end == total
    for w in windows:
        assert w.end > w.start
        assert w.frames == w.end - w.start


DEFAULT_ENDS = {
    0: [],
    1: [1],
    3: [3],
    4: [4],
    5: [4, 5],
    28: [4, 28],
    29: [4, 29],
    30: [4, 29, 30],
    54: [4, 29, 54],
    100: [4, 29, 54, 79, 100],
}


@pytest.mark.parametrize("total", sorted(DEFAULT_ENDS))
def test_default_schedule_boundaries(total):
    windows = all_windows(ChunkSchedule(), total)
    assert [w.end for w in windows] == DEFAULT_ENDS[total]
    assert_covers(windows, total)
    if windows:
        assert windows[0] == Window(0, windows[0].end)


def test_default_schedule_windows():
    assert all_windows(ChunkSchedule(), 100) == [
        Window(0, 4),
        Window(4, 29),
        Window(29, 54),
        Window(54, 79),
        Window(79, 100),
    ]


def test_windows_become_ready_at_the_right_push():
    pushed, final = cut(ChunkSchedule(), [1] * 54)
    ready_at = [i + 1 for i, ws in enumerate(pushed) if ws]  # frames pushed when a window came out
    assert ready_at == [4, 29, 54]
    assert all(len(ws) <= 1 for ws in pushed)
    assert final == []  # 54 = 4 + 2 * 25: nothing left


def test_one_push_can_release_several_windows():
    schedule = ChunkSchedule()
    pushed, final = cut(schedule, [3, 60, 0])
    assert pushed == [[], [Window(0, 4), Window(4, 29), Window(29, 54)], []]
    assert final == [Window(54, 63)]


def test_coverage_exactly_once():
    for first, chunk, total, step in itertools.product(
        [1, 4], [1, 7, 25], [0, 1, 3, 4, 5, 28, 29, 30, 54, 100], [1, 3, 25]
    ):
        schedule = ChunkSchedule(first_chunk_frames=first, chunk_frames=chunk)
        windows = all_windows(schedule, total, step)
        assert_covers(windows, total)
        if windows:
            assert windows[0].end == min(first, total)
            # every window but the first and the last emits exactly its chunk size
            assert all(w.end - w.start == chunk for w in windows[1:-1])


def test_first_chunk_of_one_frame():
    assert all_windows(ChunkSchedule(1, 25), 30) == [Window(0, 1), Window(1, 26), Window(26, 30)]


def test_finish_with_nothing_left():
    cutter = ChunkCutter(ChunkSchedule())
    assert cutter.push(29) == [Window(0, 4), Window(4, 29)]
    assert cutter.finish() == []
    assert ChunkSchedule().cutter().finish() == []


def test_cutter_misuse():
    cutter = ChunkSchedule().cutter()
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="n_new_frames"):
            cutter.push(bad)
    cutter.finish()
    with pytest.raises(RuntimeError):
        cutter.push(1)
    with pytest.raises(RuntimeError):
        cutter.finish()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"first_chunk_frames": 0}, "first_chunk_frames"),
        ({"first_chunk_frames": -4}, "first_chunk_frames"),
        ({"first_chunk_frames": 4.0}, "first_chunk_frames"),
        ({"chunk_frames": 0}, "chunk_frames"),
        ({"chunk_frames": True}, "chunk_frames"),
        ({"chunk_frames": "25"}, "chunk_frames"),
    ],
)
def test_schedule_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ChunkSchedule(**kwargs)


def test_core_chunking_is_torch_free():
    import os
    import pathlib
    import subprocess
    import sys

    import omnistage

    root = str(pathlib.Path(omnistage.__file__).resolve().parents[1])
    code = "import sys, omnistage.core.chunking; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})


def test_policy_gives_the_light_schedule_only_while_load_is_light():
    usual, light = ChunkSchedule(4, 25), ChunkSchedule(2, 25)
    policy = ChunkPolicy(usual, light, light_load_requests=2)
    assert [policy.for_load(n) for n in (1, 2, 3, 64)] == [light, light, usual, usual]
    assert ChunkPolicy(usual).for_load(1) is usual  # no light schedule: always the usual one
    assert all_windows(light, 40)[0] == Window(0, 2) and all_windows(usual, 40)[0] == Window(0, 4)


def test_playback_schedule_ramps_up_from_the_first_chunk():
    playback = ChunkSchedule(4, 25).for_playback()
    sizes = [w.frames for w in all_windows(playback, 200)]
    # the first at least PLAYBACK_FIRST_FRAMES; each later one 3/5 of the frames cut before it, at least
    # PLAYBACK_MIN_FRAMES, at most chunk_frames
    assert sizes == [6, 4, 6, 9, 15, 24, 25, 25, 25, 25, 25, 11]
    assert [w.frames for w in all_windows(ChunkSchedule(1, 25).for_playback(), 12)] == [6, 4, 2]
    assert [w.frames for w in all_windows(ChunkSchedule(8, 25).for_playback(), 14)] == [8, 4, 2]  # a larger first
    assert [w.frames for w in all_windows(ChunkSchedule(4, 2).for_playback(), 9)] == [6, 2, 1]  # capped


@pytest.mark.parametrize("step", [1, 3, 25])
def test_playback_schedule_covers_every_frame_once(step):
    for total in (0, 1, 4, 5, 8, 27, 41, 100):
        assert_covers(all_windows(ChunkSchedule(4, 25).for_playback(), total, step), total)


def test_policy_gives_the_playback_schedule_on_request():
    usual, light = ChunkSchedule(4, 25), ChunkSchedule(2, 25)
    policy = ChunkPolicy(usual, light, light_load_requests=1)
    assert policy.for_load(1, playback=True) == ChunkSchedule(6, 25, playback=True)  # light or not: 6 at least
    assert policy.for_load(5, playback=True) == ChunkSchedule(6, 25, playback=True)
    assert ChunkPolicy(ChunkSchedule(8, 25)).for_load(5, playback=True) == ChunkSchedule(8, 25, playback=True)
    assert policy.for_load(5) is usual
