# TritonPool over scripted per-server clients: least in-flight routing, failover before the first chunk,
# no replay after it, probe-driven take-out and re-admission, and a clear 503 when every server is down.
import asyncio
from contextlib import aclosing

import pytest

from omnistage.core.errors import EngineError
from openai_frontend.omni_client import OmniChunk, OmniClient
from openai_frontend.triton_codec import TritonUnavailableError
from openai_frontend.triton_pool import TritonPool, client_for

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "hi"}]


class Server(OmniClient):
    """One scripted server: answers `name`, or fails as told; `hold` keeps streams open until set."""

    def __init__(self, name: str):
        self.name, self.up, self.fail_after_first = name, True, False
        self.hold = asyncio.Event()
        self.hold.set()
        self.requests = 0

    async def stream(self, messages, parameters, *, request_id=""):
        if not self.up:
            raise TritonUnavailableError(f"cannot reach {self.name}")
        self.requests += 1
        yield OmniChunk(text=self.name)
        await self.hold.wait()
        if self.fail_after_first:
            raise TritonUnavailableError(f"{self.name} went away")
        yield OmniChunk(finish_reason="stop")

    async def ready(self) -> bool:
        return self.up


async def served_by(pool: TritonPool) -> str:
    async with aclosing(pool.stream(MESSAGES, {})) as chunks:
        return "".join([c.text async for c in chunks])


def make_pool(*names, probe_interval_s=3600.0):
    servers = {n: Server(n) for n in names}
    return TritonPool(servers, probe_interval_s=probe_interval_s), servers


async def test_least_in_flight_server_gets_the_next_request():
    pool, servers = make_pool("a", "b")
    servers["a"].hold.clear()
    held = pool.stream(MESSAGES, {})
    assert (await anext(held)).text == "a"  # a has one in flight now
    assert [await served_by(pool) for _ in range(3)] == ["b", "b", "b"]
    servers["a"].hold.set()
    await held.aclose()
    assert [b["in_flight"] for b in pool.status()] == [0, 0]
    assert sorted([await served_by(pool) for _ in range(4)]) == ["a", "a", "b", "b"]  # idle: ties rotate
    await pool.close()


async def test_unreachable_server_is_skipped_and_taken_out():
    pool, servers = make_pool("a", "b")
    servers["a"].up = False
    assert [await served_by(pool) for _ in range(4)] == ["b"] * 4
    assert [b["healthy"] for b in pool.status()] == [False, True]
    assert servers["b"].requests == 4 and "cannot reach a" in pool.status()[0]["last_error"]
    await pool.close()


async def test_failure_after_output_is_not_replayed():
    pool, servers = make_pool("a", "b")
    servers["a"].fail_after_first = True
    with pytest.raises(TritonUnavailableError, match="a went away"):
        await served_by(pool)
    assert servers["b"].requests == 0  # the client already had "a"'s text: no second answer
    assert pool.status()[0]["healthy"] is False
    await pool.close()


async def test_probe_readmits_a_recovered_server():
    pool, servers = make_pool("a", "b", probe_interval_s=0.05)
    servers["a"].up = False
    assert await served_by(pool) == "b"
    servers["a"].up = True
    for _ in range(100):  # the probe task, started by the first request, brings a back
        if pool.status()[0]["healthy"]:
            break
        await asyncio.sleep(0.02)
    assert pool.status()[0]["healthy"]
    assert sorted([await served_by(pool) for _ in range(2)]) == ["a", "b"]
    await pool.close()


async def test_all_down_is_a_503_naming_the_servers():
    pool, servers = make_pool("a", "b")
    for s in servers.values():
        s.up = False
    with pytest.raises(TritonUnavailableError, match=r"no Triton server available \(a: .*; b: ") as e:
        await served_by(pool)
    assert e.value.code == 503
    assert await pool.ready() is False
    servers["b"].up = True
    assert await pool.ready() is True
    await pool.close()


async def test_other_errors_pass_through_without_taking_the_server_out():
    class Broken(Server):
        async def stream(self, messages, parameters, *, request_id=""):
            raise EngineError("boom")
            yield

    pool = TritonPool({"a": Broken("a")})
    with pytest.raises(EngineError):
        await served_by(pool)
    assert pool.status()[0]["healthy"] is True
    await pool.close()


def test_one_url_needs_no_pool_and_duplicates_are_refused():
    single = client_for(["x:1"], Server)
    assert isinstance(single, Server)
    assert isinstance(client_for(["x:1", "y:1"], Server), TritonPool)
    with pytest.raises(ValueError, match="twice"):
        client_for(["x:1", "x:1"], Server)
