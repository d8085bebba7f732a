# OpenAI's multi-turn audio through the openai SDK: a spoken reply's audio.id names a kept copy, and a later
# request's assistant message {"audio": {"id"}} reaches the backend as that reply's transcript.
import openai
import pytest

from openai_frontend.audio_store import AudioStore

from .fake_omni import Script, Step, tone

USER = [{"role": "user", "content": "Say hello."}]


def spoken() -> Script:
    return Script(steps=[Step("Hello", audio=tone(1920)), Step(" there", audio=tone(960))])


@pytest.mark.parametrize("stream", [False, True])
def test_a_later_turn_refers_to_the_spoken_reply_by_id(openai_client, fake, stream):
    fake.script = spoken()
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text", "audio"],
                                              audio={"voice": "ethan", "format": "wav"}, stream=stream)  # fmt: skip
    if stream:
        audio = [c.choices[0].delta.audio for c in r if c.choices and c.choices[0].delta.audio]
        audio_id, expires_at = audio[0].id, audio[-1].expires_at
    else:
        audio_id, expires_at = r.choices[0].message.audio.id, r.choices[0].message.audio.expires_at
    fake.script = Script()
    follow_up = [*USER, {"role": "assistant", "audio": {"id": audio_id}}, {"role": "user", "content": "Again."}]
    r2 = openai_client.chat.completions.create(model="qwen3-omni", messages=follow_up, modalities=["text"])
    assert r2.choices[0].message.content == "Hello world"
    assert fake.calls[1]["messages"][1] == {"role": "assistant", "content": "Hello there"}
    assert expires_at >= r2.created + 3000  # the server's window (an hour by default)


def test_unknown_audio_id_is_a_400(openai_client, fake):
    follow_up = [*USER, {"role": "assistant", "audio": {"id": "audio_0123"}}, {"role": "user", "content": "Again."}]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="qwen3-omni", messages=follow_up)
    assert (e.value.body["param"], e.value.body["code"]) == ("messages[1].audio.id", "audio_not_found")
    assert fake.calls == []


def test_text_only_replies_are_not_kept(openai_client, fake):
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"])
    assert r.choices[0].message.audio is None and r.choices[0].message.content == "Hello world"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_is_bounded_by_age_count_and_bytes():
    clock = Clock()
    store = AudioStore(max_items=2, max_bytes=100, ttl_s=60, clock=clock)
    store.keep("a", "one", store.expires_at())
    clock.now += 30
    store.keep("b", "two", store.expires_at())
    assert store.get("a").transcript == "one" and store.get("b").transcript == "two"
    clock.now += 31  # a is past its window, b is not
    assert store.get("a") is None and store.get("b").transcript == "two"
    store.keep("c", "c" * 10, store.expires_at())
    store.keep("d", "d" * 10, store.expires_at())  # three would exceed the count: the oldest goes
    assert [store.get(k) is not None for k in "bcd"] == [False, True, True]
    store.keep("e", "é" * 45, store.expires_at())  # 90 bytes of utf-8: 110 would exceed the budget, c goes
    assert [store.get(k) is not None for k in "cde"] == [False, True, True]
    store.keep("f", "f" * 101, store.expires_at())  # larger than the whole budget: not kept
    assert store.get("f") is None and store.get("e") is not None
