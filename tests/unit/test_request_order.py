# omni_ensemble's request flow (pipeline/request.py) with scripted stages, in the order Triton's BLS imposes:
# a stage call is sent when it is made and returns with its first response, so the talker's start, made on
# the thinker's thread, holds that thread until the talker's first frames. The first text token must be
# out before that, and the appends after it.
import threading

import torch

from omnistage.core.chunking import ChunkSchedule
from omnistage.models.tokenizer import build_tokenizer
from omnistage.pipeline.options import OmniOptions
from omnistage.pipeline.request import OmniRequest

from .test_tool_call_unspoken import COND, ScriptedStages, rows


class SentWhenCalled(ScriptedStages):
    """The talker's start as the BLS client makes it: sent at the call, returning once its first response is
    in (here: at once), with what had been emitted by then recorded."""

    def __init__(self, thinker_outputs, emitted):
        super().__init__(thinker_outputs)
        self.emitted, self.calls = emitted, []

    def talker(self, session, inputs, parameters):
        self.calls.append(("start", len(self.emitted)))
        return iter([{"codes": torch.zeros(2, 16, dtype=torch.long)}])

    def talker_append(self, session, rows, end):
        self.calls.append(("append", len(self.emitted)))


def test_the_first_token_is_out_before_the_talker_starts():
    tokenizer = build_tokenizer()
    hello, there = tokenizer.encode("Hello"), tokenizer.encode(" there")
    emitted, done = [], threading.Event()
    stages = SentWhenCalled([
        {"token_ids": torch.tensor(hello), "text_rows": rows(hello), **COND},
        {"token_ids": torch.tensor(there), "text_rows": rows(there)},
        {"token_ids": torch.tensor([151645]), "text_rows": torch.zeros(0, 8), "finish_reason": "stop"},
    ], emitted)  # fmt: skip

    def emit(output, finish_reason, error):
        if output is not None and output.text:
            emitted.append(output.text)
        if finish_reason or error:
            done.set()

    options = OmniOptions.from_parameters({"modalities": "text,audio"}, {"ethan"})
    OmniRequest("s", {"input_ids": torch.tensor([1, 2])}, options, stages, tokenizer, ChunkSchedule(4, 25),
                emit).run()  # fmt: skip
    assert done.is_set() and "".join(emitted).startswith("Hello there")
    # each of the thinker's outputs went to the client before it went to the talker
    assert stages.calls == [("start", 1), ("append", 2), ("append", 2)]


def test_a_client_that_leaves_during_the_talker_start_frees_the_talker():
    # the cancel comes while the start is on its way (the BLS call has not returned): the talker gets an
    # abort after its start, not only one that may have overtaken it
    calls = []

    class LeftDuringStart(ScriptedStages):
        box = {}

        def talker(self, session, inputs, parameters):
            calls.append("start")
            self.box["request"].cancel()
            return iter([])

        def abort(self, stage, session):
            calls.append(f"abort {stage}")

    run_cancelled_during_start(LeftDuringStart)
    assert calls.index("start") < len(calls) - 1 - calls[::-1].index("abort talker")


def test_a_failed_abort_after_the_talker_start_still_reads_the_talker_stream():
    # the talker may be restarting when that abort goes out: its stream must still be read to its end, or
    # the 2.51 stub never frees it and the talker holds the slot until its idle timeout
    read = []

    class AbortFails(ScriptedStages):
        box = {}

        def talker(self, session, inputs, parameters):
            self.box["request"].cancel()

            def stream():
                yield {"codes": torch.zeros(2, 16, dtype=torch.long)}
                read.append("end")

            return stream()

        def abort(self, stage, session):
            raise RuntimeError("talker unavailable")

    run_cancelled_during_start(AbortFails)
    assert read == ["end"]


def run_cancelled_during_start(stages_class) -> None:
    """A one-token reply through `stages_class`, whose talker() may cancel box["request"] (the request)."""
    hello = build_tokenizer().encode("Hello")
    stages = stages_class([{"token_ids": torch.tensor(hello), "text_rows": rows(hello), **COND},
                           {"token_ids": torch.tensor([151645]), "text_rows": torch.zeros(0, 8),
                            "finish_reason": "stop"}])  # fmt: skip
    options = OmniOptions.from_parameters({"modalities": "text,audio"}, {"ethan"})
    stages.box["request"] = OmniRequest("s", {"input_ids": torch.tensor([1, 2])}, options, stages,
                                        build_tokenizer(), ChunkSchedule(4, 25), lambda *a: None)  # fmt: skip
    stages.box["request"].run()
