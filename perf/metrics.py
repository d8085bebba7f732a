# Per-request measurements and their aggregation, with vLLM-Omni's benchmark definitions so that the
# numbers compare with theirs (perf/README.md, Method):
#   TTFT : request start -> first SSE chunk with reply text
#   TTFP : request start -> first SSE chunk carrying audio ("audio time to first packet")
#   E2E  : request start -> end of the stream
#   RTF  : (time of the last audio chunk - request start) / decoded audio seconds
#   throughput: completed requests / wall time of the level
# Pure Python (no numpy): unit-tested on CPU.
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

SAMPLE_RATE = 24000  # Code2Wav output, mono
STATS = ("mean", "median", "p99")


@dataclass
class RequestRecord:
    index: int  # prompt index within the level
    # perf_counter just before the POST (CLOCK_MONOTONIC on Linux: comparable with the server's trace stamps)
    start: float = 0.0
    id: str | None = None  # the completion's id (the frontend's request id: the trace's join key)
    sent: float | None = None  # seconds since start when the request's last byte was written
    ttft: float | None = None  # seconds since start
    ttfp: float | None = None
    last_audio: float | None = None
    e2e: float | None = None
    audio_samples: int = 0  # decoded pcm16 samples
    text_chunks: int = 0
    audio_chunks: int = 0
    prompt_tokens: int | None = None  # from the usage chunk
    completion_tokens: int | None = None
    audio_frames: int | None = None
    finish_reason: str | None = None
    status: str = "pending"  # ok | error | cut (stopped by a deadline) | pending
    error: str | None = None

    @property
    def audio_s(self) -> float:
        return self.audio_samples / SAMPLE_RATE

    @property
    def rtf(self) -> float | None:
        if self.last_audio is None or self.audio_samples == 0:
            return None
        return self.last_audio / self.audio_s

    def to_json(self) -> dict:
        out = asdict(self)
        out["audio_s"] = self.audio_s
        out["rtf"] = self.rtf
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict | None:
    """{mean, median, p99, n} of the non-None values times scale (1000 for ms), or None when empty."""
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "median": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    note: str | None = None

    def summary(self) -> dict:
        done = [r for r in self.records if r.status == "ok"]
        errors = Counter((r.error or "?")[:200] for r in self.records if r.status == "error")
        cut = [r for r in self.records if r.status in ("cut", "pending")]
        return {
            "concurrency": self.concurrency,
            "num_prompts": self.num_prompts,
            "sent": sum(1 for r in self.records if r.status != "pending"),
            "completed": len(done),
            "failed": sum(errors.values()),
            "cut_by_deadline": len(cut),
            "wall_s": self.wall_s,
            "throughput_rps": len(done) / self.wall_s if self.wall_s > 0 else None,
            # completed requests only, as vLLM-Omni reports them
            "ttft_ms": summarize([r.ttft for r in done], 1000.0),
            "ttfp_ms": summarize([r.ttfp for r in done], 1000.0),
            "e2e_ms": summarize([r.e2e for r in done], 1000.0),
            "rtf": summarize([r.rtf for r in done]),
            "audio_s": summarize([r.audio_s for r in done]),
            "completion_tokens": summarize([r.completion_tokens for r in done]),
            "audio_frames": summarize([r.audio_frames for r in done]),
            # first packets of requests a deadline stopped: a slow server still shows its TTFP
            "ttfp_ms_incl_cut": summarize([r.ttfp for r in done + cut], 1000.0),
            "errors": dict(errors),
            "note": self.note,
        }


def ratio(ours: float | None, baseline: float | None) -> float | None:
    if ours is None or baseline in (None, 0):
        return None
    return ours / baseline
