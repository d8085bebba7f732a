# Custom Prometheus metrics of a model instance, published on Triton's metrics port next to Triton's own
# per-model metrics. One small thread per instance is the only caller of the metrics API: it samples
# gauges and counters from a stats callable a few times per second and replays histogram observations
# that other threads queued. Concurrent metric updates from several stub threads crash tritonserver 2.51
# (boost interprocess lock_exception), so the engine loop, the request threads and execute() never touch
# pb_utils metrics themselves. docs/operations.md says how to read them.
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch
import triton_python_backend_utils as pb_utils

from ..stages.kv_budget import KVPlan

log = logging.getLogger(__name__)

PERIOD_SECONDS = 0.25

Labels = tuple[tuple[str, str], ...]
# what a stats callable returns: (metric name, extra labels, value) for gauges and counter totals
Sample = list[tuple[str, dict[str, str], float]]


class MetricsPublisher:
    def __init__(self, owner: str, instance: str, sample: Callable[[], Sample] | None = None):
        self.owner, self.labels, self.sample = owner, {"instance": instance}, sample
        self._kinds: dict[str, tuple[str, str, list[float] | None]] = {}  # name -> (kind, help, buckets)
        self._label_sets: dict[str, list[dict[str, str]]] = {}
        self._families: dict[str, object] = {}  # a garbage-collected MetricFamily invalidates its metrics
        self._metrics: dict[tuple[str, Labels], object] = {}
        self._totals: dict[tuple[str, Labels], float] = {}  # counters: what was already added
        self._observations: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{owner}-metrics", daemon=True)

    # Every label set is declared up front: families and metrics are all created by start(), on the
    # thread that runs initialize() (as Triton's own examples do), never later from the metrics thread.
    def gauge(self, name: str, text: str, label_sets: list[dict[str, str]] | None = None) -> MetricsPublisher:
        return self._declare(name, "GAUGE", text, None, label_sets)

    def counter(self, name: str, text: str, label_sets: list[dict[str, str]] | None = None) -> MetricsPublisher:
        return self._declare(name, "COUNTER", text, None, label_sets)

    def histogram(self, name: str, text: str, buckets: list[float],
                  label_sets: list[dict[str, str]] | None = None) -> MetricsPublisher:  # fmt: skip
        return self._declare(name, "HISTOGRAM", text, list(buckets), label_sets)

    def _declare(self, name, kind, text, buckets, label_sets) -> MetricsPublisher:
        self._kinds[name] = (kind, text, buckets)
        self._label_sets[name] = label_sets or [{}]
        return self

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Any thread: the observation is queued and published by the metrics thread."""
        self._observations.put((name, labels, float(value)))

    def start(self) -> None:
        try:
            for name, (kind, text, buckets) in self._kinds.items():
                self._families[name] = pb_utils.MetricFamily(name, text, getattr(pb_utils.MetricFamily, kind))
                for labels in self._label_sets[name]:
                    kw = {"buckets": buckets} if buckets is not None else {}
                    key = (name, tuple(sorted(labels.items())))
                    self._metrics[key] = self._families[name].Metric(labels={**self.labels, **labels}, **kw)
        except Exception as e:  # metrics disabled on the server (--allow-metrics=false)
            log.warning("[%s] custom metrics unavailable: %s", self.owner, e)
            return
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _metric(self, name: str, labels: dict[str, str]):
        key = (name, tuple(sorted(labels.items())))
        return self._metrics[key], key  # KeyError: a label set that was not declared

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_SECONDS):
            try:
                self._publish()
            except Exception:  # a bad value must not end the thread and with it every metric
                log.exception("[%s] publishing metrics failed", self.owner)

    def _publish(self) -> None:
        for name, labels, value in self.sample() if self.sample else ():
            metric, key = self._metric(name, labels)
            if self._kinds[name][0] == "GAUGE":
                metric.set(value)
            elif value > self._totals.get(key, 0):
                metric.increment(value - self._totals.get(key, 0))
                self._totals[key] = value
        while True:
            try:
                name, labels, value = self._observations.get_nowait()
            except queue.Empty:
                return
            self._metric(name, labels)[0].observe(value)


_STAGE_GAUGES = {
    "slots_in_use": "KV-cache slots held by running requests",
    "requests_running": "requests holding a slot",
    "requests_waiting": "requests queued for a slot",
    "batch_size": "sequences in the last engine step",
    "step_ms": "duration of the last engine step in milliseconds",
    "responses_pending": "requests with an open response stream",
    "kv_cache_slots": "rows of the instance's decode batch (max_batch_size)",
    "kv_cache_bytes": "bytes of the instance's paged KV pool",
    "kv_blocks_used": "KV pool blocks held by sequences or kept prefixes",
    "kv_blocks_total": "KV pool blocks (16 positions each)",
    "requests_waiting_for_slots": "requests queued because every slot (batch row) is taken",
    "requests_waiting_for_blocks": "requests queued because the KV pool cannot hold their prompt and reserve",
    "gpu_memory_peak_bytes": "peak GPU memory torch allocated in the instance (0 on CPU)",
}
_STAGE_COUNTERS = {
    "steps_total": "engine steps run",
    "preemptions_total": "running sequences sent back to the queue for KV blocks (recomputed later)",
    "responses_total": "responses sent",
    "prefill_seconds_total": "seconds the engine spent in prefills",
    "decode_seconds_total": "seconds the engine spent in decode steps (its busy share: / wall time)",
    "decode_rows_total": "sequences over all decode steps (/ steps: mean decode batch)",
    "prefill_rows_total": "sequences prefilled (prefill_seconds_total / this: a prompt's share of the device)",
    "queue_seconds_total": "summed seconds from a request's arrival at the engine to the prefill that took it",
    "first_outputs_total": "requests whose first output the engine produced",
    "first_output_seconds_total": "their seconds from arrival at the engine to that output (before the "
                                  "response thread)",
    "response_encode_seconds_total": "seconds the response thread spent making response tensors",
    "response_send_seconds_total": "seconds the response thread spent in Triton's send()",
    "response_poll_seconds_total": "seconds the response thread spent asking whether clients left (is_cancelled())",
    "response_delay_seconds_total": "summed seconds from an output's hand-over to the response thread to its "
                                    "response sent (/ responses_total: the mean wait there)",
    "response_pickup_seconds_total": "the part of response_delay_seconds_total until the response thread took the "
                                     "output off its queue (the rest: its round's sends)",
    "first_responses_total": "requests answered with data (their first output sent)",
    "first_response_seconds_total": "their seconds from arrival to that first response sent: the stage's part of "
                                    "a request's first output (queue, first step, response thread)",
    "prompts_in_decode_total": "prompts prefilled in a decode step's forward (one read of the experts for both) "
                               "rather than in their own",
}
_THINKER_COUNTERS = {  # the thinker's runner stats (ThinkerRunner.stats)
    "prefix_cache_prompt_tokens_total": "prompt tokens of text-only prompts looked up in the prefix cache",
    "prefix_cache_hit_tokens_total": "prompt tokens whose K/V came from the prefix cache instead of a prefill",
    "pieces_in_decode_total": "long prompts' pieces run in a decode step's forward (one read of the experts for "
                              "both) rather than in their own",
}


class StageMetrics(MetricsPublisher):
    """omni_<stage>_* of a thinker or talker instance, sampled from its engine and responder."""

    def __init__(self, stage: str, instance: str, engine, responder, kv: KVPlan, device: torch.device):
        super().__init__(stage, instance, self._sample_stage)
        self.stage, self.engine, self.responder, self.kv, self.device = stage, engine, responder, kv, device
        for name, text in _STAGE_GAUGES.items():
            self.gauge(f"omni_{stage}_{name}", text)
        self.counters = {**_STAGE_COUNTERS, **(_THINKER_COUNTERS if stage == "thinker" else {})}
        for name, text in self.counters.items():
            self.counter(f"omni_{stage}_{name}", text)

    def _sample_stage(self) -> Sample:
        s = self.engine.stats()
        values = {
            "slots_in_use": s["slots_in_use"],
            "requests_running": s["running"],
            "requests_waiting": s["waiting"],
            "batch_size": s["last_batch_size"],
            "step_ms": s["last_step_ms"],
            "responses_pending": self.responder.active,
            "steps_total": s["steps"],
            "responses_total": self.responder.responses_sent,
            "prefill_seconds_total": s["prefill_seconds"],
            "decode_seconds_total": s["decode_seconds"],
            "decode_rows_total": s["decoded_rows"],
            "prefill_rows_total": s["prefilled_rows"],
            "queue_seconds_total": s["queue_seconds"],
            "first_outputs_total": s["first_outputs"],
            "first_output_seconds_total": s["first_output_seconds"],
            "response_encode_seconds_total": self.responder.encode_seconds,
            "response_send_seconds_total": self.responder.send_seconds,
            "response_poll_seconds_total": self.responder.poll_seconds,
            "response_delay_seconds_total": self.responder.delay_seconds,
            "response_pickup_seconds_total": self.responder.pickup_seconds,
            "first_responses_total": self.responder.first_responses,
            "first_response_seconds_total": self.responder.first_response_seconds,
            "kv_cache_slots": self.kv.slots,
            "kv_cache_bytes": self.kv.cache_bytes,
            "kv_blocks_used": s["kv_blocks_used"],
            "kv_blocks_total": s["kv_blocks_total"],
            "requests_waiting_for_slots": s["waiting_for_slots"],
            "requests_waiting_for_blocks": s["waiting_for_blocks"],
            "preemptions_total": s["preemptions"],
            "gpu_memory_peak_bytes": self._peak_gpu_bytes(),
            "prompts_in_decode_total": s["prompts_in_decode"],
        }
        if "prefix_cache_hit_tokens_total" in self.counters:
            values["prefix_cache_prompt_tokens_total"] = s["prefix_prompt_tokens"]
            values["prefix_cache_hit_tokens_total"] = s["prefix_hit_tokens"]
            values["pieces_in_decode_total"] = s["pieces_in_decode"]
        return [(f"omni_{self.stage}_{name}", {}, value) for name, value in values.items()]

    def _peak_gpu_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
