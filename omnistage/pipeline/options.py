# What one omni_ensemble request asks for, validated before any stage is touched: modalities, voice and
# the per-stage request parameters (thinker: plain names; talker: `talker_` prefix, vLLM-Omni's
# sampling_params_list flattened).
from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import BadRequestError
from ..core.protocol import SAMPLING_PARAMETERS
from ..core.sampling import SamplingParams, coerce_parameter, sampling_from_parameters
from ..core.voices import DEFAULT_VOICE, resolve_voice

MODALITIES = {"text": (True, False), "audio": (False, True), "text,audio": (True, True), "audio,text": (True, True)}


@dataclass(frozen=True)
class OmniOptions:
    want_text: bool
    want_audio: bool
    speaker: str
    thinker_parameters: dict  # forwarded as the thinker request's parameters
    talker_parameters: dict
    use_audio_in_video: bool = False  # video parts bring their audio track (preprocessing and the thinker)
    playback: bool = False  # chunk_schedule "playback": the audio is played as it arrives (core/chunking.py)

    @classmethod
    def from_parameters(cls, parameters: dict, speakers: set[str], default_speaker: str = DEFAULT_VOICE) -> "OmniOptions":
        known = (set(SAMPLING_PARAMETERS) | {f"talker_{k}" for k in SAMPLING_PARAMETERS}
                 | {"modalities", "speaker", "use_audio_in_video", "chunk_schedule"})
        unknown = sorted(set(parameters) - known - _TRITON_RESERVED)
        if unknown:
            raise BadRequestError(f"unknown parameter(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
        modalities = str(parameters.get("modalities", "text,audio")).replace(" ", "").lower()
        if modalities not in MODALITIES:
            raise BadRequestError(f"modalities must be one of text, audio, text,audio; got {modalities!r}",
                                  param="modalities", code="invalid_value")
        want_text, want_audio = MODALITIES[modalities]
        speaker = resolve_voice(parameters.get("speaker"), sorted(speakers), default=default_speaker, param="speaker") \
            if want_audio else default_speaker
        thinker = {k: parameters[k] for k in SAMPLING_PARAMETERS if k in parameters}
        talker = {k: parameters[f"talker_{k}"] for k in SAMPLING_PARAMETERS if f"talker_{k}" in parameters}
        # reject bad values now (400 before anything starts); the context bound is each stage's own
        sampling_from_parameters(thinker, SamplingParams())
        sampling_from_parameters(talker, SamplingParams())
        audio_in_video = coerce_parameter("use_audio_in_video", bool, parameters.get("use_audio_in_video", False))
        if audio_in_video:
            thinker["use_audio_in_video"] = True
        schedule = parameters.get("chunk_schedule", "fixed")
        if schedule not in ("fixed", "playback"):
            raise BadRequestError(f"chunk_schedule must be 'fixed' or 'playback', got {schedule!r}",
                                  param="chunk_schedule", code="invalid_value")  # fmt: skip
        return cls(want_text, want_audio, speaker, thinker, talker, audio_in_video, schedule == "playback")


# parameters Triton itself may attach to a request
_TRITON_RESERVED = {"triton_enable_empty_final_response", "sequence_id", "sequence_start", "sequence_end",
                    "priority", "binary_data_output"}  # fmt: skip
