# omni_ensemble's request flow with scripted stages: the talker hears the reply up to a <tool_call> token
# and its utterance ends there (the call goes back as text, for the frontend to return as tool_calls).
import threading

import torch

from omnistage.core.chunking import ChunkSchedule
from omnistage.models.tokenizer import build_tokenizer
from omnistage.pipeline.options import OmniOptions
from omnistage.pipeline.request import OmniRequest

D = 8
COND = {"talker_user_is_mm": torch.zeros(3, dtype=torch.bool), "talker_user_ids": torch.zeros(3, dtype=torch.long),
        "talker_special_rows": torch.zeros(6, D)}  # fmt: skip


class ScriptedStages:
    def __init__(self, thinker_outputs):
        self.thinker_outputs, self.talker_rows, self.appends = thinker_outputs, [], []

    def thinker(self, session, inputs, parameters):
        yield from self.thinker_outputs

    def talker(self, session, inputs, parameters):
        self.talker_rows.append(inputs["text_rows"])
        self.start_end = parameters["text_end"]
        yield {"codes": torch.zeros(2, 16, dtype=torch.long)}

    def talker_append(self, session, rows, end):
        self.appends.append((None if rows is None else rows.shape[0], end))

    def abort(self, stage, session):
        pass

    def code2wav(self, session, codes, start, end):
        return torch.zeros(0 if codes is None else codes.shape[0] * 1920)


def rows(ids):
    return torch.arange(len(ids), dtype=torch.float32)[:, None].expand(len(ids), D) + ids[0]


def test_the_talker_stops_where_a_tool_call_begins():
    tokenizer = build_tokenizer()
    call = tokenizer.convert_tokens_to_ids("<tool_call>")
    ok, sure = tokenizer.encode("OK"), tokenizer.encode(" sure.")
    block = [call, *tokenizer.encode('{"name": "f"}'), tokenizer.convert_tokens_to_ids("</tool_call>")]
    stages = ScriptedStages([
        {"token_ids": torch.tensor(ok), "text_rows": rows(ok), **COND},
        {"token_ids": torch.tensor(sure + block[:2]), "text_rows": rows(sure + block[:2])},
        {"token_ids": torch.tensor(block[2:]), "text_rows": rows(block[2:])},
        {"token_ids": torch.tensor([151645]), "text_rows": torch.zeros(0, D), "finish_reason": "stop"},
    ])  # fmt: skip
    got, done = [], threading.Event()

    def emit(output, finish_reason, error):
        got.append(output)
        if finish_reason or error:
            done.set()

    options = OmniOptions.from_parameters({"modalities": "text,audio"}, {"ethan"})
    request = OmniRequest("s", {"input_ids": torch.tensor([1, 2])}, options, stages, tokenizer, ChunkSchedule(4, 25),
                          emit)  # fmt: skip
    request.run()
    assert done.is_set()
    # the talker heard "OK" and " sure." and nothing of the call; the utterance ended there, once
    assert [r.shape[0] for r in stages.talker_rows] == [len(ok)] and not stages.start_end
    assert stages.appends == [(len(sure), True)]
    text = "".join(o.text for o in got if o is not None)
    assert text.startswith("OK sure.<tool_call>") and "</tool_call>" in text  # the text keeps the call
