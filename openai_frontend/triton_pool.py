# Several Triton servers behind one frontend: an OmniClient over one OmniClient per server.
#
# Routing: each request goes to the healthy server with the fewest requests in flight from this frontend
# (ties rotate). The frontend cannot see other frontends' load, but every request of a server passes
# through some frontend, so with one frontend per server group this is the servers' real load.
# Failure: a server that cannot be reached (TritonUnavailableError: connection refused, UNAVAILABLE) is
# taken out at once, and the request moves to the next server as long as nothing of it has been streamed
# yet; once output has gone to the client the error is the client's. A probe task asks every server
# for readiness every `probe_interval_s` and re-admits the ones that answer again.
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from openai_frontend.omni_client import OmniChunk, OmniClient
from openai_frontend.triton_codec import TritonUnavailableError

log = logging.getLogger("openai_frontend.pool")


@dataclass(eq=False)
class Backend:
    url: str
    client: OmniClient
    healthy: bool = True  # optimistic at start: the first failure or probe says otherwise
    in_flight: int = 0
    served: int = 0  # requests routed here (for status and tests)
    last_error: str = ""


class TritonPool(OmniClient):
    def __init__(self, clients: dict[str, OmniClient], *, probe_interval_s: float = 2.0):
        if not clients:
            raise ValueError("a pool needs at least one server")
        self.backends = [Backend(url, client) for url, client in clients.items()]
        self.probe_interval_s = probe_interval_s
        self._probe_task: asyncio.Task | None = None
        self._next = 0

    # ---- OmniClient ---------------------------------------------------------------------------------------
    async def stream(
        self, messages: list[dict[str, Any]], parameters: dict[str, Any], *, request_id: str = ""
    ) -> AsyncIterator[OmniChunk]:
        self._start_probe()
        tried: set[int] = set()
        while True:
            backend = self._pick(tried)
            if backend is None:
                down = "; ".join(f"{b.url}: {b.last_error or 'down'}" for b in self.backends if not b.healthy)
                raise TritonUnavailableError(f"no Triton server available ({down})")
            tried.add(id(backend))
            backend.in_flight += 1
            backend.served += 1
            streamed = False
            try:
                async with aclosing(backend.client.stream(messages, parameters, request_id=request_id)) as chunks:
                    async for chunk in chunks:
                        streamed = True
                        yield chunk
                return
            except TritonUnavailableError as e:
                self._mark_down(backend, str(e))
                if streamed:
                    raise
                log.warning("request %s: %s unavailable, trying another server", request_id, backend.url)
            finally:
                backend.in_flight -= 1

    async def start(self) -> None:
        for b in self.backends:
            await b.client.start()
        self._start_probe()

    def health_report(self) -> dict | None:
        reports = {b.url: b.client.health_report() for b in self.backends}
        return reports if any(r is not None for r in reports.values()) else None

    async def ready(self) -> bool:
        self._start_probe()
        await self.probe()
        return any(b.healthy for b in self.backends)

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            self._probe_task = None
        for b in self.backends:
            await b.client.close()

    # ---- routing and health -------------------------------------------------------------------------------
    def _pick(self, tried: set[int]) -> Backend | None:
        n = len(self.backends)
        order = [self.backends[(self._next + i) % n] for i in range(n)]
        candidates = [b for b in order if b.healthy and id(b) not in tried]
        if not candidates:
            return None
        best = min(candidates, key=lambda b: b.in_flight)
        self._next = (self.backends.index(best) + 1) % n
        return best

    def _mark_down(self, backend: Backend, error: str) -> None:
        backend.last_error = error
        if backend.healthy:
            backend.healthy = False
            log.warning("Triton %s taken out of the pool: %s", backend.url, error)

    async def probe(self) -> None:
        """Asks every server for readiness at once; the answers decide who is in the pool."""
        answers = await asyncio.gather(*(b.client.ready() for b in self.backends), return_exceptions=True)
        for backend, answer in zip(self.backends, answers):
            if answer is True:
                if not backend.healthy:
                    backend.healthy = True
                    log.warning("Triton %s is ready again: back in the pool", backend.url)
            else:
                self._mark_down(backend, f"not ready ({answer})" if isinstance(answer, Exception) else "not ready")

    def _start_probe(self) -> None:
        # here rather than in __init__: the task must live on uvicorn's event loop, which starts later
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe()
            except Exception:  # the probe must outlive any one bad answer
                log.exception("Triton pool probe failed")

    def status(self) -> list[dict[str, Any]]:
        return [{"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "served": b.served,
                 "last_error": b.last_error} for b in self.backends]  # fmt: skip


def client_for(urls: list[str], make: Callable[[str], OmniClient], probe_interval_s: float = 2.0) -> OmniClient:
    """One server: its client as it is; several: a pool over them."""
    if len(urls) == 1:
        return make(urls[0])
    if len(set(urls)) != len(urls):
        raise ValueError(f"--triton-url lists a server twice: {urls}")
    return TritonPool({url: make(url) for url in urls}, probe_interval_s=probe_interval_s)
