# Triton glue of the talker stage. One talker stream is driven by several requests sharing a session
# (see protocol.TALKER): `start` opens it, `append` feeds the thinker's reply rows as they come, `abort`
# ends it. Appends and aborts are answered at once with an empty final response.
from __future__ import annotations

from dataclasses import replace

from ..core.errors import BadRequestError
from ..core.sampling import SamplingParams, coerce_parameter
from ..core.scheduler import Sequence
from ..stages.talker import TalkerOutput, TalkerPrompt, TalkerRunner
from ..stages.thinker import TalkerConditioning
from .responder import send_final
from .stage_model import StageModel
from .tensors import from_torch, input_tensor, string_tensor

# vLLM-Omni's deploy defaults for the talker
TALKER_DEFAULTS = SamplingParams(max_tokens=4096, temperature=0.9, top_k=50, repetition_penalty=1.05)


class TalkerModel(StageModel):
    STAGE = "talker"

    def build_runner(self, model):
        self.speakers = {k.lower(): v for k, v in self.config.talker_config.speaker_id.items()}
        return TalkerRunner(model, self.config, max_slots=self.max_slots, max_seq_len=self.max_seq_len,
                            device=self.device, dtype=self.dtype)  # fmt: skip

    def default_sampling(self) -> SamplingParams:
        return replace(TALKER_DEFAULTS, max_tokens=min(TALKER_DEFAULTS.max_tokens, self.max_seq_len // 2))

    def sequence_from(self, request, params: dict, request_id: str) -> Sequence:
        required = ["talker_user_rows", "talker_user_is_mm", "talker_user_ids", "talker_special_rows", "text_rows"]
        t = {name: input_tensor(request, name) for name in required}
        missing = [name for name, value in t.items() if value is None]
        if missing:
            raise BadRequestError(f"talker start is missing {', '.join(missing)}")
        speaker = str(params.get("speaker", "ethan")).lower()
        if speaker not in self.speakers:
            raise BadRequestError(f"unknown speaker {speaker!r}; valid: {', '.join(sorted(self.speakers))}")
        cond = TalkerConditioning(t["talker_user_rows"], t["talker_user_is_mm"].bool(), t["talker_user_ids"].long(),
                                  t["talker_special_rows"])  # fmt: skip
        prompt = TalkerPrompt(
            cond,
            self.speakers[speaker],
            image_grid_thw=input_tensor(request, "image_grid_thw"),
            audio_feature_lengths=input_tensor(request, "audio_feature_lengths"),
        )
        prompt.append(t["text_rows"], coerce_parameter("text_end", bool, params.get("text_end", False)))
        return Sequence(request_id, self.sampling(params), prompt)

    def control(self, action: str, request, params: dict, request_id: str, sender) -> None:
        if action != "append":
            raise BadRequestError(f"unknown action {action!r}")
        rows = input_tensor(request, "text_rows")
        end = coerce_parameter("text_end", bool, params.get("text_end", False))
        self.engine.update(request_id, lambda seq: seq.payload.append(rows, end))
        send_final(sender)

    def encode(self, output: TalkerOutput | None, finish_reason: str | None) -> list:
        tensors = []
        if output is not None:
            tensors.append(from_torch("codes", output.codes))
        if finish_reason is not None:
            tensors.append(string_tensor("finish_reason", finish_reason))
        return tensors
