# Watches every model of the Triton server and repairs broken ones. Triton 2.51 neither restarts a Python
# stub process that died nor reports its model unready (is_model_ready stays true), so readiness alone
# proves nothing: every `interval_s` each model gets a probe request (parameter action=probe, answered
# at once by the model's execute(), so it passes only if the stub runs; a model whose responses cannot
# leave, because a send() toward a dead caller blocks, answers it with an error). A model whose probe fails
# is down (/health 503 at once) and, when that persists for `confirm_probes` probes in a row, broken:
# dead ("Stub process ... is not healthy", also a stopped process), hung (no answer) or unable to deliver.
# Confirming first matters: the backend also says "not healthy" when a live stub misses its 1 s
# health-lock deadline on a starved CPU, and a reload fails every request in flight on the server.
# A broken model is reloaded through Triton's model-control API (the server must run with
# --model-control-mode=explicit) with a config that forces a fresh stub (workarounds.py, 1), and after a
# stage the models that call it through BLS (omni_ensemble) too: their threads that wait on the dead
# stage's streams go with their old stub. Before a reload the `on_outage` callbacks run: the client fails
# its open requests to this server (and refuses new ones while `serving` is false). `/health` is ready
# only while every model is READY and its latest probe passed.
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.grpc import aio as grpcclient

from omnistage.core.errors import PROBE_ACTION
from omnistage.triton.workarounds import BLS_CALLERS, forced_reload_config

log = logging.getLogger("openai_frontend.watchdog")

UNANSWERED = "probe not answered"

_NUMPY = {"TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP16": np.float16,
          "TYPE_FP32": np.float32, "TYPE_BF16": np.float32, "TYPE_STRING": np.object_}  # fmt: skip


@dataclass
class ModelHealth:
    ok: bool = False
    error: str | None = "not probed yet"
    reloads: int = 0
    last_reload: float = 0.0
    failures: int = 0  # failed probes in a row
    probed: bool = False  # its latest failure is a probe's (not a state other than READY)
    recovery_s: list[float] = field(default_factory=list)  # first failed probe to serving again, per outage
    down_since: float = 0.0


class StageWatchdog:
    def __init__(self, url: str, *, interval_s: float = 1.0, timeout_s: float = 10.0, reload: bool = True,
                 reload_backoff_s: float = 10.0, confirm_probes: int = 3, headers: dict[str, str] | None = None):  # fmt: skip
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.headers = headers or {}  # the Triton key (TRITON_GRPC_KEY_HEADER), for every call
        self.reload, self.reload_backoff_s, self.confirm_probes = reload, reload_backoff_s, confirm_probes
        # called with a model's name when its open requests cannot end (its stub died): before its reload
        self.on_outage: list[Callable[[str], None]] = []
        self.models: dict[str, ModelHealth] = {}
        self.checked = False  # one full round done
        self._first_round = asyncio.Event()
        self._inputs: dict[str, list[InferInput]] = {}
        self._client: grpcclient.InferenceServerClient | None = None
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.checked and bool(self.models) and all(m.ok for m in self.models.values())

    async def ready(self) -> bool:
        """healthy, after waiting (up to the probe timeout) for the first round of probes after start."""
        if not self.checked and self._task is not None:
            try:
                await asyncio.wait_for(self._first_round.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.healthy

    @property
    def serving(self) -> bool:
        """False while a model is confirmed broken (being reloaded): new requests are refused meanwhile."""
        return all(m.failures < self.confirm_probes for m in self.models.values())

    def report(self) -> dict:
        return {name: {"ok": m.ok, "error": m.error, "reloads": m.reloads,
                       "recovery_s": [round(s, 2) for s in m.recovery_s]} for name, m in sorted(self.models.items())}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"stage-watchdog {self.url}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    async def _loop(self) -> None:
        self._client = grpcclient.InferenceServerClient(self.url)
        while True:
            try:
                await self.check()
            except Exception as e:  # noqa: BLE001 - Triton unreachable: every model counts as down
                for m in self.models.values():
                    m.ok, m.error = False, f"Triton unreachable: {e}"
                self.checked = True
                self._first_round.set()
                log.warning("watchdog: cannot check Triton at %s: %s", self.url, e)
            await asyncio.sleep(self.interval_s)

    async def check(self) -> None:
        index = await self._client.get_model_repository_index(headers=self.headers, as_json=True)
        states = {m["name"]: m.get("state", "") for m in index.get("models", [])}
        for name in list(self.models):
            if name not in states:
                del self.models[name]
        broken = await asyncio.gather(*(self._check_model(name, state) for name, state in states.items()))
        self.checked = True
        self._first_round.set()
        due = [name for name, bad in zip(states, broken) if bad and self._reload_due(self.models[name])]
        if not due or not self.reload:
            return
        # stages first, then their callers, each once: a caller's new stub starts with no thread that waits
        # on the old stage
        callers = [c for c in BLS_CALLERS if c in states and (c in due or any(n not in BLS_CALLERS for n in due))]
        self._outage(due[0])
        for name in [n for n in due if n not in BLS_CALLERS] + callers:
            await self._reload(name, self.models[name])

    def _reload_due(self, health: ModelHealth) -> bool:
        return time.monotonic() - health.last_reload >= self.reload_backoff_s

    async def _check_model(self, name: str, state: str) -> bool:
        """Probes one model; returns whether it is broken (failed confirm_probes probes in a row, or failed
        to load)."""
        health = self.models.setdefault(name, ModelHealth())
        error = f"state {state or 'UNKNOWN'}" if state != "READY" else await self._probe(name)
        if error is None:
            if not health.ok:
                log.info("watchdog: %s is serving", name)
                if health.down_since:
                    health.recovery_s.append(time.monotonic() - health.down_since)
            health.ok, health.error, health.failures, health.down_since = True, None, 0, 0.0
            return False
        if health.ok or health.error != error:
            log.warning("watchdog: %s is down: %s", name, error)
        if health.ok and not health.down_since:
            health.down_since = time.monotonic()
        health.ok, health.error = False, error
        health.failures += 1
        # LOADING / UNLOADING: Triton is at it already
        return health.failures >= self.confirm_probes and (state in ("READY", "UNAVAILABLE"))

    async def _probe(self, name: str) -> str | None:
        try:
            inputs = self._inputs.get(name) or await self._probe_inputs(name)

            async def requests():
                yield {"model_name": name, "inputs": inputs, "request_id": f"probe-{name}",
                       "parameters": {"action": PROBE_ACTION, "triton_enable_empty_final_response": True}}  # fmt: skip

            async def first_answer() -> str | None:
                async for _, error in self._client.stream_infer(requests(), headers=self.headers):
                    return None if error is None else error.message()
                return "the stream closed without an answer"

            return await asyncio.wait_for(first_answer(), self.timeout_s)
        except asyncio.TimeoutError:
            return f"{UNANSWERED} within {self.timeout_s:.0f}s"
        except Exception as e:  # noqa: BLE001 - anything but an answer is a failed probe
            return f"probe failed: {e}"

    async def _probe_inputs(self, name: str) -> list[InferInput]:
        # required inputs must be present for Triton to pass the request on; their values are never read
        config = (await self._client.get_model_config(name, headers=self.headers, as_json=True))["config"]
        inputs = []
        for spec in config.get("input", []):
            if spec.get("optional"):
                continue
            dims = [1 if int(d) < 0 else int(d) for d in spec.get("dims", [])]
            dtype = spec.get("data_type", "TYPE_FP32")
            value = np.zeros(dims, dtype=_NUMPY.get(dtype, np.float32))
            if dtype == "TYPE_STRING":
                value[...] = b"[]"
            tensor = InferInput(spec["name"], dims, dtype.removeprefix("TYPE_").replace("STRING", "BYTES"))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        self._inputs[name] = inputs
        return inputs

    def _outage(self, name: str) -> None:
        for callback in self.on_outage:
            callback(name)

    async def _reload(self, name: str, health: ModelHealth) -> None:
        health.last_reload = time.monotonic()
        health.reloads += 1
        if not health.ok:
            health.down_since = health.down_since or health.last_reload
        log.warning("watchdog: reloading %s (reload #%d)", name, health.reloads)
        started = time.monotonic()
        try:
            config = (await self._client.get_model_config(name, headers=self.headers, as_json=True))["config"]
            await self._client.load_model(name, headers=self.headers, config=forced_reload_config(config))
            self._inputs.pop(name, None)
        except Exception as e:  # noqa: BLE001 - e.g. the server is not in explicit model-control mode
            health.error = f"{health.error}; reload failed: {e}"
            log.error("watchdog: reloading %s failed: %s", name, e)
            return
        log.warning("watchdog: %s reloaded in %.1fs", name, time.monotonic() - started)
