# Responses side by side over /v1/realtime with a scripted backend, driven by the openai SDK's realtime
# client: out-of-band responses run beside the conversation's own, up to the session's bound, and
# response.cancel ends the one it names (or, without an id, the conversation's) and no other; a backend error
# fails a response, not the session.
import pytest

from omnistage.core.errors import EngineError
from openai_frontend.realtime.connection import MAX_OUT_OF_BAND

from .fake_omni import Script, Step
from .realtime_helpers import fake, sdk, server, until  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_out_of_band_responses_run_beside_the_conversations_own(server, fake):
    fake.reset()
    fake.script = Script(steps=[Step("x")], hang=True)  # every response runs until it is cancelled
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hi"}]})  # fmt: skip
        await until(conn, "conversation.item.done")
        await conn.response.create()
        own = (await until(conn, "response.created")).response
        beside = []
        for _ in range(MAX_OUT_OF_BAND):
            await conn.response.create(response={"conversation": "none", "output_modalities": ["text"]})
            beside.append((await until(conn, "response.created")).response)
        await conn.response.create(response={"conversation": "none"}, event_id="evt_more")
        more = (await until(conn, "error")).error
        await conn.response.create(event_id="evt_own")
        second = (await until(conn, "error")).error
        ended = []
        for response in [beside[1], beside[0]]:
            await conn.response.cancel(response_id=response.id)
            ended.append((await until(conn, "response.done")).response)
        await conn.response.cancel()
        ended.append((await until(conn, "response.done")).response)
        for response in beside[2:]:
            await conn.response.cancel(response_id=response.id)
            ended.append((await until(conn, "response.done")).response)
    assert own.conversation_id.startswith("conv_") and all(r.conversation_id is None for r in beside)
    assert (more.code, more.event_id) == ("too_many_active_responses", "evt_more")
    assert (second.code, second.event_id) == ("conversation_already_has_active_response", "evt_own")
    assert [r.id for r in ended] == [beside[1].id, beside[0].id, own.id] + [r.id for r in beside[2:]]
    assert all(r.status == "cancelled" and r.status_details.reason == "client_cancelled" for r in ended)
    assert len(fake.calls) == 1 + MAX_OUT_OF_BAND


async def test_a_backend_error_fails_the_response_with_its_usage(server, fake):
    """The backend's error ends the response `failed`, with the error in status_details and a usage object
    (clients read usage from every response.done); the session then answers the next response.create."""
    fake.reset()
    fake.script = Script(steps=[Step("ab"), Step("c")], error=EngineError("the talker fell over"))
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hi"}]})  # fmt: skip
        await until(conn, "conversation.item.done")
        await conn.response.create(response={"output_modalities": ["text"]})
        failed = (await until(conn, "response.done")).response
        fake.script = Script()
        await conn.response.create(response={"output_modalities": ["text"]})
        after = (await until(conn, "response.done")).response
    assert failed.status == "failed" and "talker fell over" in failed.status_details.error.message
    assert failed.output[0].status == "incomplete" and failed.output[0].content[0].text == "abc"
    usage = failed.usage
    assert (usage.output_tokens, usage.output_token_details.text_tokens, usage.output_token_details.audio_tokens) == \
        (3, 3, 0)  # fmt: skip
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert after.status == "completed"


async def test_an_agent_speaks_first_from_instructions_alone(server, fake):
    """An agent that greets first (LiveKit's generate_reply(instructions=...)) sends response.create before
    the conversation holds anything: the instructions are the prompt. With neither there is nothing to answer."""
    fake.reset()
    async with sdk(server.url).realtime.connect(model="qwen3-omni") as conn:
        await until(conn, "session.created")
        await conn.response.create(event_id="evt_nothing")
        nothing = (await until(conn, "error")).error
        await conn.response.create(response={"instructions": "Greet the user.", "metadata": {"client_event_id": "g1"}})
        created = (await until(conn, "response.created")).response
        done = (await until(conn, "response.done")).response
    assert (nothing.code, nothing.event_id) == ("empty_conversation", "evt_nothing")
    assert created.metadata == {"client_event_id": "g1"} and done.status == "completed"
    assert [call["messages"] for call in fake.calls] == [[{"role": "system", "content": "Greet the user."}]]
