# Faults on the real stack (tiny checkpoint, real tritonserver, `python -m openai_frontend` with its
# watchdog, real HTTP clients): overload is refused at once with 503 + Retry-After, clients that vanish
# at random points free every stage within a second, and a killed stage process fails its requests
# cleanly, turns /health to 503 and is reloaded.
import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from omnistage.launch.proc_stats import stub_pids
from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from ..api.servers import FrontendProcess
from .conftest import RepoSpec
from .test_omni_pipeline import gauge

MAX_INFLIGHT, MAX_QUEUE = 4, 40
USER = [{"role": "user", "content": "Tell me a story."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    spec = default_spec(str(tiny_checkpoint), "cpu")
    spec["omni_ensemble"].parameters.update(max_inflight=str(MAX_INFLIGHT), max_queue=str(MAX_QUEUE))
    return RepoSpec(models=spec, src=REPO_ROOT / "model_repository")


@pytest.fixture(scope="module")
def frontend(triton_server):
    with FrontendProcess("--triton-url", triton_server.grpc_url, "--probe-interval", "0.5") as f:
        wait_for(lambda: httpx.get(f"{f.url}/health").status_code == 200, 60, "the first healthy probe round")
        yield f
    print(f.output)


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def body(max_tokens: int, audio: bool = False, frames: int = 8, stream: bool = False) -> dict:
    b = {"messages": USER, "max_tokens": max_tokens, "modalities": ["text", "audio"] if audio else ["text"],
         "sampling_params_list": [GREEDY, dict(GREEDY, max_tokens=frames)], "stream": stream}  # fmt: skip
    return b


def stages_idle(metrics: str) -> bool:
    return all(gauge(metrics, f"omni_{s}_{g}") == 0 for s in ("thinker", "talker")
               for g in ("slots_in_use", "requests_waiting", "responses_pending"))  # fmt: skip


def test_overload_is_refused_at_once_with_503_and_retry_after(frontend, triton_server):
    n = 3 * (MAX_INFLIGHT + MAX_QUEUE)

    async def one(http, i):
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json=body(24))
        return r, time.monotonic() - t0

    async def burst():
        async with httpx.AsyncClient(base_url=frontend.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(n)))

    results = asyncio.run(burst())
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    refused = [(r, dt) for r, dt in results if r.status_code == 503]
    served = [(r, dt) for r, dt in results if r.status_code == 200]
    # at most max_inflight + max_queue were held at once; the rest were refused, not queued
    assert len(refused) >= n - 2 * (MAX_INFLIGHT + MAX_QUEUE), statuses.count(503)
    assert served and all(r.json()["usage"]["completion_tokens"] == 24 for r, _ in served)
    for r, dt in refused:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error" and "overloaded" in error["message"], error
    # refused without queueing: while the admitted ones were still draining through 4 slots
    assert max(dt for _, dt in refused) < max(dt for _, dt in served)
    assert httpx.get(f"{frontend.url}/health").status_code == 200


def test_random_disconnects_free_every_stage_within_a_second(frontend, triton_server):
    rng = random.Random(6)

    async def leave_early(http, events_to_read: int):
        async with http.stream("POST", "/v1/chat/completions", json=body(400, audio=True, frames=300, stream=True)) as r:
            assert r.status_code == 200
            read = 0
            async for line in r.aiter_lines():
                read += line.startswith("data:")
                if read >= events_to_read:
                    break  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
            # before the first token, in the text, and after audio started (the 4-frame first chunk)
            await asyncio.gather(*(leave_early(http, rng.choice([1, 2, 5, 20, 40])) for _ in range(8)))

    asyncio.run(run())
    freed = wait_for(lambda: stages_idle(triton_server.metrics()), 10, "every stage to free its slots")
    assert freed < 1.0, f"stages freed {freed:.2f}s after the last client left"
    assert httpx.post(f"{frontend.url}/v1/chat/completions", json=body(2), timeout=60).status_code == 200


def test_killed_stage_fails_its_requests_turns_health_503_and_is_reloaded(frontend, triton_server):
    talker = stub_pids(triton_server.server.process.pid)["talker"]
    events: list[dict] = []

    async def spoken_stream(http):
        async with http.stream("POST", "/v1/chat/completions", json=body(300, audio=True, frames=250, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:  # the talker is running now
                        os.kill(talker[0], signal.SIGKILL)
                        killed.append(time.monotonic())

    killed: list[float] = []

    async def run():
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
            await asyncio.wait_for(spoken_stream(http), 60)

    asyncio.run(run())
    ended = time.monotonic() - killed[0]
    assert "error" in events[-1], events[-1]  # ended by an error event, not a hang or a silent stop
    assert "restart" in events[-1]["error"]["message"] and events[-1]["error"]["type"] == "service_unavailable_error"
    assert ended < 10, ended
    down = httpx.get(f"{frontend.url}/health")
    detect = wait_for(lambda: httpx.get(f"{frontend.url}/health").status_code == 503, 5, "/health to report the dead stage") if down.status_code == 200 else 0.0
    back = wait_for(lambda: httpx.get(f"{frontend.url}/health").status_code == 200, 60, "the talker to be reloaded")
    report = httpx.get(f"{frontend.url}/health").json()["models"]
    assert report["talker"]["reloads"] >= 1 and all(m["ok"] for m in report.values()), report
    assert stub_pids(triton_server.server.process.pid)["talker"] != talker
    r = httpx.post(f"{frontend.url}/v1/chat/completions", json=body(3, audio=True, frames=6), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["audio"]["data"]
    print(f"stream ended {ended:.2f}s after the kill; /health 503 after {detect:.2f}s; healthy again {back:.2f}s later")
