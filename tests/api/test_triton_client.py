# TritonOmniClient against a fake Triton speaking the real gRPC protocol on the test's event loop.
import asyncio

import numpy as np
import pytest

from omnistage.core.errors import BadRequestError, EngineError
from openai_frontend.triton_client import TritonOmniClient
from openai_frontend.triton_codec import TritonUnavailableError

from .fake_triton import FakeTriton, Reply, closed_port, infer_response

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "audio_frames": 1}


def script(final_separately: bool = False) -> list[Reply]:
    replies = [
        Reply(infer_response(text="Hel", token_ids=[1])),
        Reply(infer_response(text="lo", token_ids=[2], audio=np.full(1920, 0.25, np.float32))),
    ]
    if final_separately:  # finish_reason in the last data response, then an empty final response
        replies.append(Reply(infer_response(finish_reason="stop", usage=USAGE)))
        replies.append(Reply(infer_response(final=True)))
    else:
        replies.append(Reply(infer_response(finish_reason="stop", usage=USAGE, final=True)))
    return replies


async def collect(client, parameters=None, **kw):
    return [c async for c in client.stream(MESSAGES, parameters or {}, **kw)]


@pytest.mark.parametrize("final_separately", [False, True])
async def test_stream_decodes_and_sends_parameters(final_separately):
    async with FakeTriton(replies=script(final_separately)) as triton:
        client = TritonOmniClient(triton.url)
        chunks = await collect(client, {"modalities": "text,audio", "speaker": "chelsie", "talker_max_tokens": 50},
                               request_id="chatcmpl-1")
        await client.close()
    assert "".join(c.text for c in chunks) == "Hello"
    assert sum(len(c.audio) for c in chunks if c.audio is not None) == 1920
    assert [c.finish_reason for c in chunks][-1] == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage == USAGE
    (req,) = triton.received
    assert (req.model_name, req.request_id, req.messages) == ("omni_ensemble", "chatcmpl-1", MESSAGES)
    assert req.parameters == {"modalities": "text,audio", "speaker": "chelsie", "talker_max_tokens": 50,
                              "triton_enable_empty_final_response": True}


async def test_stream_closed_without_final_flag_completes_from_finish_reason():
    replies = [Reply(infer_response(text="a")), Reply(infer_response(finish_reason="length"))]
    async with FakeTriton(replies=replies) as triton:
        chunks = await collect(TritonOmniClient(triton.url))
    assert chunks[-1].finish_reason == "length"


async def test_stream_closed_early_is_an_engine_error():
    async with FakeTriton(replies=[Reply(infer_response(text="a"))]) as triton:
        with pytest.raises(EngineError, match="before its final response"):
            await collect(TritonOmniClient(triton.url))


async def test_bad_request_error_from_the_model():
    replies = [Reply(error="[400] unsupported image type 'image/tiff'")]
    async with FakeTriton(replies=replies) as triton:
        with pytest.raises(BadRequestError, match="unsupported image type") as info:
            await collect(TritonOmniClient(triton.url))
    assert info.value.code == 400


async def test_error_mid_stream():
    replies = [Reply(infer_response(text="a")), Reply(error="talker failed: CUDA error")]
    async with FakeTriton(replies=replies) as triton:
        got = []
        with pytest.raises(EngineError, match="talker failed"):
            async for chunk in TritonOmniClient(triton.url).stream(MESSAGES, {}):
                got.append(chunk.text)
    assert got == ["a"]


async def test_aclose_mid_stream_cancels_the_grpc_call():
    async with FakeTriton(replies=script()[:1], hang_after_replies=True) as triton:
        stream = TritonOmniClient(triton.url).stream(MESSAGES, {})
        assert (await anext(stream)).text == "Hel"
        await stream.aclose()  # suspended at a yield: only our `finally` can cancel
        await asyncio.wait_for(triton.cancelled.wait(), 5)


async def test_task_cancellation_while_waiting_cancels_the_grpc_call():
    async with FakeTriton(replies=script()[:1], hang_after_replies=True) as triton:
        first = asyncio.Event()

        async def consume():
            async for _ in TritonOmniClient(triton.url).stream(MESSAGES, {}):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 5)
        await asyncio.sleep(0.05)  # now blocked reading the next response
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(triton.cancelled.wait(), 5)


async def test_ready():
    async with FakeTriton() as triton:
        client = TritonOmniClient(triton.url)
        assert await client.ready()
        triton.model_ready = False
        assert not await client.ready()
        assert not await TritonOmniClient(triton.url, model_name="other").ready()


async def test_unreachable_triton():
    client = TritonOmniClient(f"127.0.0.1:{closed_port()}", ready_timeout_s=1)
    assert not await client.ready()
    with pytest.raises(TritonUnavailableError) as info:
        await collect(client)
    assert info.value.code == 503
    await client.close()


async def test_a_model_that_stops_answering_probes_fails_the_open_streams_once_and_is_reloaded():
    """A hung omni_ensemble (its stub alive, answering nothing): after confirm_probes unanswered probes the
    open streams to that server end with a 503 error rather than never, and a reload is tried (this fake
    has no model control: it fails, and is not retried within the backoff)."""
    from openai_frontend.stage_watchdog import StageWatchdog
    from openai_frontend.triton_codec import StageUnavailableError

    async with FakeTriton(replies=[], hang_after_replies=True) as triton:  # nothing is ever answered
        watchdog = StageWatchdog(triton.url, interval_s=0.01, timeout_s=0.1, confirm_probes=3, reload_backoff_s=60)
        outages = []
        watchdog.on_outage.append(outages.append)
        client = TritonOmniClient(triton.url, watchdog=watchdog)
        await client.start()
        with pytest.raises(StageUnavailableError, match="lost model omni_ensemble .*stopped answering"):
            await asyncio.wait_for(collect(client), 10)
        await asyncio.sleep(0.5)  # several more unanswered probes: the same outage, no second call
        report = client.health_report()["omni_ensemble"]
        await watchdog.stop()
        await client.close()
    assert outages == ["omni_ensemble"]
    assert report["ok"] is False and "probe not answered" in report["error"] and report["reloads"] == 1
