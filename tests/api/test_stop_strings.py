# OpenAI `stop` strings: matched on the reply text across deltas, never shown even in part, and the
# backend request is cancelled at the match.
import pytest

from openai_frontend.stop_strings import StopMatcher

from .fake_omni import Script, Step, tone

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("deltas, stops, shown, stopped", [
    (["Hello E", "N", "x wo", "rld\n", "\nmore"], ["END", "\n\n"], ["Hello ", "", "ENx wo", "rld", ""], True),
    (["abc E", "ND tail"], ["END"], ["abc ", ""], True),
    (["a", "b", "c"], ["xyz"], ["a", "b", "c"], False),
    (["stop", "more"], ["stop"], ["", ""], True),
])  # fmt: skip
def test_matcher(deltas, stops, shown, stopped):
    m = StopMatcher(stops)
    assert [m.feed(d) for d in deltas] == shown and m.stopped == stopped


def test_matcher_releases_a_held_prefix_at_the_end():
    m = StopMatcher(["END"])
    assert (m.feed("abc EN"), m.flush()) == ("abc ", "EN")


def test_non_streamed_stop_cancels_the_backend(openai_client, fake):
    fake.script = Script(steps=[Step("Hello"), Step(" wor"), Step("ld, and more", audio=tone(1920)), Step("!")], hang=True)
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, stop=["rld,", "zzz"])
    assert r.choices[0].message.audio.transcript == "Hello wo" and r.choices[0].finish_reason == "stop"
    assert fake.cancelled.wait(5)  # the request was cancelled in the backend, not run to its end


def test_streamed_stop_never_shows_part_of_it(openai_client, fake):
    fake.script = Script(steps=[Step("one. "), Step("two"), Step("."), Step(" ST"), Step("OP three")], hang=True)
    chunks = list(openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"],
                                                        stop=" STOP", stream=True))  # fmt: skip
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == "one. two." and not any("S" in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert fake.cancelled.wait(5)


def test_no_match_keeps_the_whole_reply(openai_client, fake):
    r = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"], stop="Hello!")
    assert r.choices[0].message.content == "Hello world" and r.choices[0].finish_reason == "stop"
    assert fake.finished.is_set() and not fake.cancelled.is_set()
