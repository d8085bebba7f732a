# Custom Prometheus metrics of a stage instance, published on Triton's metrics port next to Triton's
# own per-model metrics. Sampled from the engine's stats a few times per second by one small thread: the
# engine loop never touches the metrics API, and no two threads update metrics at once (concurrent
# updates from several stub threads crash tritonserver 2.51: boost interprocess lock_exception).
from __future__ import annotations

import logging
import threading

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

PERIOD_SECONDS = 0.25

_GAUGES = {
    "slots_in_use": "KV-cache slots held by running requests",
    "requests_running": "requests holding a slot",
    "requests_waiting": "requests queued for a slot",
    "batch_size": "sequences in the last engine step",
    "step_ms": "duration of the last engine step in milliseconds",
    "responses_pending": "requests with an open response stream",
}
_COUNTERS = {"steps_total": "engine steps run", "responses_total": "responses sent"}


class StageMetrics:
    def __init__(self, stage: str, instance: str, engine, responder):
        self.engine, self.responder = engine, responder
        labels = {"instance": instance}
        self._gauges, self._counters = {}, {}
        self._families = []  # a garbage-collected MetricFamily invalidates its metrics, so keep them
        self._last = {"steps_total": 0, "responses_total": 0}
        try:
            for name, text in _GAUGES.items():
                family = pb_utils.MetricFamily(f"omni_{stage}_{name}", text, pb_utils.MetricFamily.GAUGE)
                self._families.append(family)
                self._gauges[name] = family.Metric(labels=labels)
            for name, text in _COUNTERS.items():
                family = pb_utils.MetricFamily(f"omni_{stage}_{name}", text, pb_utils.MetricFamily.COUNTER)
                self._families.append(family)
                self._counters[name] = family.Metric(labels=labels)
        except Exception as e:  # metrics disabled on the server (--allow-metrics=false)
            log.warning("[%s] custom metrics unavailable: %s", stage, e)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{stage}-metrics", daemon=True)

    def start(self) -> None:
        if self._gauges:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_SECONDS):
            s = self.engine.stats()
            values = {
                "slots_in_use": s["slots_in_use"],
                "requests_running": s["running"],
                "requests_waiting": s["waiting"],
                "batch_size": s["last_batch_size"],
                "step_ms": s["last_step_ms"],
                "responses_pending": self.responder.active,
            }
            for name, value in values.items():
                self._gauges[name].set(value)
            totals = {"steps_total": s["steps"], "responses_total": self.responder.responses_sent}
            for name, total in totals.items():
                if total > self._last[name]:
                    self._counters[name].increment(total - self._last[name])
                    self._last[name] = total
