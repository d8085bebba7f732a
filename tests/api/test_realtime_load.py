# perf/realtime_load.py against the frontend over a scripted backend: every turn is measured from the end of
# speech that the server reported, and an answer whose next chunk comes after the audio before it has played
# out counts as an underrun.
import json

from perf import realtime_load

from .fake_omni import FakeOmniClient, Script, Step, tone
from .realtime_helpers import serve

FIRST_DELAY_S = 0.2


def test_load_measures_latency_and_underruns(tmp_path):
    fake = FakeOmniClient()
    # 0.16 s of audio, then the next chunk 0.6 s later: the speaker runs dry before it, whatever the machine
    fake.script = Script(steps=[Step("Hi", audio=tone(1920 * 2), delay_s=FIRST_DELAY_S),
                                Step("!", audio=tone(1920 * 2), delay_s=0.6)])  # fmt: skip
    out = tmp_path / "load.json"
    with serve(fake, api_key=None) as srv:
        realtime_load.main(["--url", srv.url, "--sessions", "2", "--turns", "2", "--warmup", "0", "--out", str(out)])
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["sessions"], level["turns"], level["completed_turns"], level["failed_turns"]) == (2, 4, 4, 0)
    assert level["latency_ms"]["p50"] >= FIRST_DELAY_S * 1000  # the backend's own delay is inside it
    assert level["underruns"] == 4 and level["turns_with_underruns"] == 4
    # each second delta came ~0.6 s after the first, whose 160 ms had played out by then: no lead, a gap
    assert level["lead_ms"]["min"] <= level["lead_ms"]["p50"] < 0
    assert len(fake.calls) == 4
    assert all(any(p["type"] == "input_audio" for p in m["content"]) for c in fake.calls
               for m in c["messages"] if m["role"] == "user")  # fmt: skip
