# Stage requests and responses as plain dicts of named tensors (the names of core/protocol.py), so the
# Triton glue only converts tensors, and tests can drive the same mapping without Triton.
from __future__ import annotations

import torch

from dataclasses import replace

from ..core.errors import BadRequestError
from ..core.sampling import SamplingParams, coerce_parameter, sampling_from_parameters
from ..core.scheduler import Sequence
from ..core.voices import resolve_voice
from .conditioning import TalkerConditioning
from .talker import TalkerOutput, TalkerPrompt
from .thinker import ThinkerOutput, ThinkerPrompt

Tensors = dict  # name -> torch.Tensor (or str for TYPE_STRING outputs)

# vLLM-Omni's deploy defaults for the talker: temperature 0.9, top-k 50, repetition penalty 1.05
_TALKER_DEFAULTS = SamplingParams(max_tokens=4096, temperature=0.9, top_k=50, repetition_penalty=1.05)


def thinker_defaults(max_seq_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=min(2048, max_seq_len // 2))


def talker_defaults(max_seq_len: int) -> SamplingParams:
    return replace(_TALKER_DEFAULTS, max_tokens=min(_TALKER_DEFAULTS.max_tokens, max_seq_len // 2))


def thinker_sequence(session: str, inputs: Tensors, params: dict, defaults: SamplingParams) -> Sequence:
    ids = inputs.get("input_ids")
    if ids is None:
        raise BadRequestError("input_ids is required")
    prompt = ThinkerPrompt(
        input_ids=ids.reshape(-1).long(),
        pixel_values=inputs.get("pixel_values"),
        image_grid_thw=inputs.get("image_grid_thw"),
        input_features=inputs.get("input_features"),
        feature_attention_mask=inputs.get("feature_attention_mask"),
        pixel_values_videos=inputs.get("pixel_values_videos"),
        video_grid_thw=inputs.get("video_grid_thw"),
        video_second_per_grid=inputs.get("video_second_per_grid"),
        use_audio_in_video=coerce_parameter("use_audio_in_video", bool, params.get("use_audio_in_video", False)),
        export_talker=coerce_parameter("export_talker", bool, params.get("export_talker", False)),
    )
    if (prompt.pixel_values is None) != (prompt.image_grid_thw is None):
        raise BadRequestError("pixel_values and image_grid_thw go together")
    if (prompt.input_features is None) != (prompt.feature_attention_mask is None):
        raise BadRequestError("input_features and feature_attention_mask go together")
    if (prompt.pixel_values_videos is None) != (prompt.video_grid_thw is None):
        raise BadRequestError("pixel_values_videos and video_grid_thw go together")
    return Sequence(session, sampling_from_parameters(params, defaults), prompt)


def thinker_response(output: ThinkerOutput | None, finish_reason: str | None) -> Tensors:
    out: Tensors = {}
    if output is not None:
        out["token_ids"] = torch.tensor(output.token_ids, dtype=torch.int64)
        if output.text_rows is not None:
            out["text_rows"] = output.text_rows
        if output.talker is not None:
            c = output.talker
            out.update(talker_user_is_mm=c.user_is_mm, talker_user_ids=c.user_ids.long(),
                       talker_special_rows=c.special_rows)  # fmt: skip
            if c.media_rows.shape[0]:  # an empty tensor is no input for some clients (perf_analyzer)
                out["talker_media_rows"] = c.media_rows
        if output.prompt_tokens is not None:
            out["prompt_tokens"] = torch.tensor([output.prompt_tokens], dtype=torch.int64)
        if output.cached_tokens is not None:
            out["cached_tokens"] = torch.tensor([output.cached_tokens], dtype=torch.int64)
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out


_TALKER_START = ("talker_user_is_mm", "talker_user_ids", "talker_special_rows", "text_rows")


def talker_sequence(
    session: str, inputs: Tensors, params: dict, defaults: SamplingParams, speakers: dict[str, int], vocab_size: int
) -> Sequence:
    """vocab_size: rows of the thinker's embedding table, where the talker looks up talker_user_ids."""
    missing = [name for name in _TALKER_START if inputs.get(name) is None]
    if missing:
        raise BadRequestError(f"talker start is missing {', '.join(missing)}")
    speaker = resolve_voice(params.get("speaker"), sorted(speakers), param="speaker")
    ids, is_mm = inputs["talker_user_ids"].reshape(-1).long(), inputs["talker_user_is_mm"].reshape(-1).bool()
    special, media = inputs["talker_special_rows"], inputs.get("talker_media_rows")
    width = special.shape[-1]
    media = special.new_zeros(0, width) if media is None else media
    if is_mm.shape != ids.shape:
        raise BadRequestError(f"talker_user_is_mm has {is_mm.numel()} rows, talker_user_ids {ids.numel()}")
    if media.dim() != 2 or media.shape[0] != int(is_mm.sum()) or media.shape[1] != width:
        raise BadRequestError(f"talker_media_rows must be [{int(is_mm.sum())}, {width}] (one row per media "
                              f"position of talker_user_is_mm), not {list(media.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BadRequestError(f"talker_user_ids must lie in [0, {vocab_size})")
    cond = TalkerConditioning(media, is_mm, ids, special)
    prompt = TalkerPrompt(cond, speakers[speaker], image_grid_thw=inputs.get("image_grid_thw"),
                          audio_feature_lengths=inputs.get("audio_feature_lengths"),
                          video_grid_thw=inputs.get("video_grid_thw"),
                          video_second_per_grid=inputs.get("video_second_per_grid"))  # fmt: skip
    prompt.append(inputs["text_rows"], text_end(params))
    return Sequence(session, sampling_from_parameters(params, defaults), prompt)


def text_end(params: dict) -> bool:
    return coerce_parameter("text_end", bool, params.get("text_end", False))


def talker_response(output: TalkerOutput | None, finish_reason: str | None) -> Tensors:
    out: Tensors = {}
    if output is not None:
        out["codes"] = output.codes
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out
