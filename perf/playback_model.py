# Whether a chunk schedule keeps a reply's audio ahead of its playback: a small model of one request, on the
# CPU, from the schedule (core/chunking.py's own cutter), the talker's time per frame and a Code2Wav call's
# latency. The talker makes frame i at i * frame_ms; each chunk the cutter releases is one Code2Wav call, a
# session's calls one after another (stages/code2wav_stage.py takes one chunk per session at a time), the
# first through the first lane (first_call_ms), the others call_ms. Playback starts when the first chunk's
# audio is back and plays 80 ms per frame; a chunk that comes back after the audio before it has finished
# playing is an underrun, and playback resumes from it: perf/realtime_load.py's definition.
#
#   python -m perf.playback_model            # margins of the fixed and playback schedules, a 40-frame reply
#   python -m perf.playback_model --rules    # playback rules of the same form side by side, all reply lengths
from __future__ import annotations

import argparse
from dataclasses import dataclass

from omnistage.core.chunking import PLAYBACK_FIRST_FRAMES, PLAYBACK_MIN_FRAMES, ChunkSchedule

FRAME_MS = 80.0  # one codec frame of audio (12.5 Hz)


@dataclass
class Playback:
    chunks: list[int]  # frames per chunk, in order
    margin_ms: float  # the least time between a chunk's audio coming back and the end of the audio before it
    underruns: int
    gap_ms: float  # summed silence of the underruns
    first_audio_ms: float  # the first chunk back (from the talker's start)
    last_audio_ms: float  # the last chunk back


def simulate(schedule: ChunkSchedule, frames: int, frame_ms: float, first_call_ms: float, call_ms: float,
             pipelined: bool = False) -> Playback:  # fmt: skip
    """One reply of `frames` frames. pipelined: a chunk's call goes out as soon as its frames exist, even
    while the previous call is out (its audio still comes back in order)."""
    released: list[tuple[float, int]] = []  # (time the chunk's frames exist, its frames)
    cutter = schedule.cutter()
    for i in range(1, frames + 1):
        released += [(i * frame_ms, w.frames) for w in cutter.push(1)]
    released += [(frames * frame_ms, w.frames) for w in cutter.finish()]
    back: list[float] = []
    for k, (ready, _) in enumerate(released):
        latency = first_call_ms if k == 0 else call_ms
        start = ready if pipelined or not back else max(ready, back[-1])
        back.append(max(start + latency, back[-1]) if back else start + latency)
    margin, underruns, gap = float("inf"), 0, 0.0
    playing_from, played = (back[0] if back else 0.0), 0.0  # playback's start (moved by gaps), audio played
    for at, (_, n) in zip(back, released):
        if played:
            margin = min(margin, playing_from + played - at)
            if at > playing_from + played:
                underruns, gap = underruns + 1, gap + at - playing_from - played
                playing_from = at - played
        played += n * FRAME_MS
    return Playback([n for _, n in released], margin, underruns, gap, back[0] if back else 0.0,
                    back[-1] if back else 0.0)  # fmt: skip


@dataclass(frozen=True)
class RampRule(ChunkSchedule):
    """A playback rule of ChunkSchedule's form with other constants: each later chunk `share` of the
    frames before it, at least `min_frames`, at most chunk_frames."""

    min_frames: int = PLAYBACK_MIN_FRAMES
    share: float = 0.6

    def next_frames(self, emitted: int) -> int:
        if emitted == 0:
            return self.first_chunk_frames
        return min(self.chunk_frames, max(self.min_frames, int(emitted * self.share)))


def compare_rules(frame_ms: list[float], call_ms: list[float], first_call_ms: float) -> None:
    """The worst margin over reply lengths 5..120 per (talker, call) point, for rules of the playback form."""
    print(f"worst margin ms over 5..120-frame replies; first Code2Wav call {first_call_ms:g} ms; "
          f"columns: later call {', '.join(f'{c:g}' for c in call_ms)} ms")  # fmt: skip
    for min_frames in (3, 4, 5):
        for share in (0.5, 0.6, 0.75, 1.0):
            rule = RampRule(first_chunk_frames=PLAYBACK_FIRST_FRAMES, min_frames=min_frames, share=share)
            print(f"min {min_frames}, share {share}: chunks {simulate(rule, 60, 1, 0, 0).chunks}")
            for f in frame_ms:
                worst = [min(simulate(rule, n, f, first_call_ms, c).margin_ms for n in range(5, 121)) for c in call_ms]
                print(f"  talker {f:4g} ms/frame  " + " ".join(f"{w:6.0f}" for w in worst))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.playback_model", description=__doc__)
    ap.add_argument("--frames", type=int, default=40, help="reply length in codec frames (realtime_load: 40)")
    ap.add_argument("--frame-ms", type=float, nargs="+", default=[20, 30, 40, 45, 50],
                    help="the talker's time per frame under load")  # fmt: skip
    ap.add_argument("--first-call-ms", type=float, default=30.0)
    ap.add_argument("--call-ms", type=float, nargs="+", default=[100, 150, 250])
    ap.add_argument("--rules", action="store_true", help="compare playback rules instead")
    args = ap.parse_args(argv)
    if args.rules:
        compare_rules(args.frame_ms, args.call_ms, args.first_call_ms)
        return 0
    base = ChunkSchedule()
    print(f"{args.frames} frames, first Code2Wav call {args.first_call_ms:g} ms; "
          "margin ms (underruns) in series / pipelined")  # fmt: skip
    for name, schedule in (("fixed", base), ("playback", base.for_playback())):
        print(f"{name}: chunks {simulate(schedule, args.frames, 1, 0, 0).chunks}")
        for frame_ms in args.frame_ms:
            cells = []
            for call_ms in args.call_ms:
                s, p = (simulate(schedule, args.frames, frame_ms, args.first_call_ms, call_ms, pipelined)
                        for pipelined in (False, True))  # fmt: skip
                cells.append(f"call {call_ms:g}: {s.margin_ms:6.0f} ({s.underruns}) / {p.margin_ms:6.0f} ({p.underruns})")
            print(f"  talker {frame_ms:4g} ms/frame  " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
