# The frontend's Prometheus metrics (GET /metrics), one registry per app so that several apps in one
# process (tests) do not share counters. Triton's own per-model metrics stay on Triton's metrics port.
#
#   omni_frontend_requests_total{route, status}   HTTP responses by route and status code
#   omni_frontend_requests_in_flight              chat requests being served (streams included)
#   omni_frontend_queue_seconds                   arrival -> request handed to Triton (body parsing, media
#                                                 decoding/fetching, anything that waits in front of Triton)
#   omni_frontend_time_to_first_token_seconds     arrival -> first text token
#   omni_frontend_audio_ttfp_seconds              arrival -> first audio chunk
#   omni_frontend_e2e_seconds                     arrival -> last backend response
#   omni_frontend_rtf                             (last audio chunk - arrival) / audio seconds, per request
#   omni_frontend_audio_seconds_total             audio produced
#   omni_frontend_{prompt,completion}_tokens_total, omni_frontend_audio_frames_total
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnistage.core.request_trace import request_trace

_LATENCY = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, "omni_frontend_"
        self.requests = Counter(p + "requests", "HTTP responses by route and status", ("route", "status"), registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "chat requests being served", registry=r)
        self.queue = Histogram(p + "queue_seconds", "arrival to Triton submission", buckets=_LATENCY, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY, registry=r)
        self.ttfp = Histogram(p + "audio_ttfp_seconds", "arrival to first audio chunk", buckets=_LATENCY, registry=r)
        self.e2e = Histogram(p + "e2e_seconds", "arrival to last response", buckets=_LATENCY, registry=r)
        self.rtf = Histogram(p + "rtf", "real-time factor per request", buckets=_RTF, registry=r)
        self.audio_seconds = Counter(p + "audio_seconds", "audio produced (s)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "text tokens generated", registry=r)
        self.audio_frames = Counter(p + "audio_frames", "codec frames generated", registry=r)
        # per-request timestamps for perf/trace_join.py, when OMNI_TRACE_DIR is set (core/request_trace.py)
        self.trace = request_trace("frontend")


class RequestMeter:
    """Timestamps of one chat request; every observation is made at most once."""

    def __init__(self, metrics: FrontendMetrics | None, arrival: float | None = None, sample_rate: int = 24000,
                 request_id: str | None = None):  # fmt: skip
        self.metrics = metrics
        self.request_id = request_id  # the id the backend request carries (the trace's join key)
        self.handled = time.perf_counter()  # made once the request is parsed and planned, before the backend
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.sample_rate = sample_rate
        self.samples = 0
        self.first_token: float | None = None
        self.first_audio: float | None = None
        self.last_audio: float | None = None
        self._open = False

    def start(self) -> None:
        if self.metrics is not None and not self._open:
            self._open = True
            self.metrics.in_flight.inc()

    def submitted(self) -> None:
        self._observe("queue", time.perf_counter())

    def tokens(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.perf_counter()
            self._observe("ttft", self.first_token)

    def audio(self, samples: int) -> None:
        if not samples:
            return
        self.last_audio = time.perf_counter()
        if self.first_audio is None:
            self.first_audio = self.last_audio
            self._observe("ttfp", self.first_audio)
        self.samples += samples

    def finish(self, usage: dict[str, Any] | None) -> None:
        """The backend completed the request (not called for errors and cancellations)."""
        m = self.metrics
        if m is None:
            return
        self._observe("e2e", time.perf_counter())
        seconds = self.samples / self.sample_rate
        if seconds > 0:
            m.audio_seconds.inc(seconds)
            m.rtf.observe((self.last_audio - self.arrival) / seconds)
        usage = usage or {}
        m.prompt_tokens.inc(int(usage.get("prompt_tokens", 0)))
        m.completion_tokens.inc(int(usage.get("completion_tokens", 0)))
        m.audio_frames.inc(int(usage.get("audio_frames", 0)))

    def close(self) -> None:
        if self._open:
            self._open = False
            self.metrics.in_flight.dec()
            if self.metrics.trace is not None and self.request_id:
                self.metrics.trace.write({"id": self.request_id, "arrival": self.arrival, "handled": self.handled,
                                          "first_token": self.first_token, "first_audio": self.first_audio,
                                          "last_audio": self.last_audio, "end": time.perf_counter()})  # fmt: skip

    def _observe(self, name: str, at: float) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).observe(at - self.arrival)
