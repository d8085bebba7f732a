# Triton glue of the talker stage. One talker stream is driven by several requests sharing a session
# (see protocol.TALKER): `start` opens it, `append` feeds the thinker's reply rows as they come, `abort`
# ends it. Appends and aborts are answered at once with an empty final response. A stream whose caller stops
# appending before the text's end is cancelled after CALLER_SILENT_SECONDS (workarounds.py, 12).
from __future__ import annotations

from ..core.errors import BadRequestError
from ..core.protocol import TALKER
from ..models.checkpoint import load_text_embeddings
from ..stages.talker import TalkerRunner
from ..stages.wire import talker_defaults, talker_response, talker_sequence, text_end
from .responder import send_final
from .stage_model import StageModel
from .tensors import input_tensor, input_tensors
from .workarounds import CALLER_SILENT_SECONDS

class TalkerModel(StageModel):
    STAGE = "talker"

    def build_runner(self, model):
        self.speakers = {k.lower(): v for k, v in self.config.talker_config.speaker_id.items()}
        table = load_text_embeddings(self.params["model_path"], self.dtype, self.device)
        return TalkerRunner(model, self.config, table, max_slots=self.max_slots, max_seq_len=self.max_seq_len,
                            device=self.device, dtype=self.dtype, cuda_graphs=self.cuda_graphs,
                            max_prefills=self.max_prefills, kv_cache_bytes=self.kv_cache_bytes)  # fmt: skip

    def sequence_from(self, request, params: dict, request_id: str):
        inputs = input_tensors(request, TALKER)
        defaults = self.sampling_defaults(talker_defaults(self.max_seq_len))
        vocab_size = self.engine.runner.text_embeddings.shape[0]
        seq = talker_sequence(request_id, inputs, params, defaults, self.speakers, vocab_size)
        if not seq.payload.text_end:
            self.responder.expect_caller(request_id, CALLER_SILENT_SECONDS)
        return seq

    def control(self, action: str, request, params: dict, request_id: str, sender) -> None:
        if action != "append":
            raise BadRequestError(f"unknown action {action!r}")
        rows, end = input_tensor(request, "text_rows"), text_end(params)
        self.engine.update(request_id, lambda seq: seq.payload.append(rows, end))
        self.responder.heard_from(request_id, last=end)
        send_final(sender)

    def encode(self, output, finish_reason):
        return talker_response(output, finish_reason)
