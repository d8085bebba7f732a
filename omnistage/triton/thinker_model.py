# Triton glue of the thinker stage: request tensors -> ThinkerPrompt, ThinkerOutput -> response tensors.
from __future__ import annotations

import torch

from ..core.errors import BadRequestError
from ..core.sampling import SamplingParams, coerce_parameter
from ..core.scheduler import Sequence
from ..stages.thinker import ThinkerOutput, ThinkerPrompt, ThinkerRunner
from .stage_model import StageModel
from .tensors import from_torch, input_tensor, string_tensor


class ThinkerModel(StageModel):
    STAGE = "thinker"

    def build_runner(self, model):
        return ThinkerRunner(model, self.config, max_slots=self.max_slots, max_seq_len=self.max_seq_len,
                             device=self.device, dtype=self.dtype)  # fmt: skip

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=min(2048, self.max_seq_len // 2))

    def sequence_from(self, request, params: dict, request_id: str) -> Sequence:
        ids = input_tensor(request, "input_ids")
        if ids is None:
            raise BadRequestError("input_ids is required")
        prompt = ThinkerPrompt(
            input_ids=ids.reshape(-1).long(),
            pixel_values=input_tensor(request, "pixel_values"),
            image_grid_thw=input_tensor(request, "image_grid_thw"),
            input_features=input_tensor(request, "input_features"),
            feature_attention_mask=input_tensor(request, "feature_attention_mask"),
            export_talker=coerce_parameter("export_talker", bool, params.get("export_talker", False)),
        )
        if (prompt.pixel_values is None) != (prompt.image_grid_thw is None):
            raise BadRequestError("pixel_values and image_grid_thw go together")
        if (prompt.input_features is None) != (prompt.feature_attention_mask is None):
            raise BadRequestError("input_features and feature_attention_mask go together")
        return Sequence(request_id, self.sampling(params), prompt)

    def encode(self, output: ThinkerOutput | None, finish_reason: str | None) -> list:
        tensors = []
        if output is not None:
            tensors.append(from_torch("token_ids", torch.tensor(output.token_ids, dtype=torch.int64)))
            if output.text_rows is not None:
                tensors.append(from_torch("text_rows", output.text_rows))
            if output.talker is not None:
                c = output.talker
                tensors += [
                    from_torch("talker_user_rows", c.user_rows),
                    from_torch("talker_user_is_mm", c.user_is_mm),
                    from_torch("talker_user_ids", c.user_ids.long()),
                    from_torch("talker_special_rows", c.special_rows),
                ]
            if output.prompt_tokens is not None:
                tensors.append(from_torch("prompt_tokens", torch.tensor([output.prompt_tokens], dtype=torch.int64)))
        if finish_reason is not None:
            tensors.append(string_tensor("finish_reason", finish_reason))
        return tensors
