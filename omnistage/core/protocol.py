# Tensor contracts of the four Triton models, defined once. config.pbtxt files are rendered from (and
# unit-tested against) these specs, and both the Triton glue and the clients take names from here.
#
# Float tensors that cross a stage boundary are FP32 on the wire: the models may run in bf16, and
# bf16 -> fp32 -> bf16 is lossless, while fp32 keeps numpy (CPU) and DLPack (GPU) paths identical.
from __future__ import annotations

from dataclasses import dataclass, field

CODE_GROUPS = 16  # codec codebooks per frame (talker codebook 0 + 15 from the code predictor)
SAMPLE_RATE = 24000  # Code2Wav output rate, mono
# Request parameter of omni_ensemble's BLS calls: the stage answers with its host tensors as BF16 views of
# their bytes, for which Triton 2.51's stub makes no numpy array of the data (bf16_bytes.py)
BLS_TRANSPORT = "bls_transport"
BLS_TRANSPORT_BF16_BYTES = "bf16_bytes"
# Triton's model control, shared memory, trace, logging and (by default) inference answer only calls that
# carry the server's key in this header (HTTP; on gRPC with Triton's prefix); the launcher hands it to the
# frontend in this environment variable
TRITON_KEY_HEADER = "omnistage-triton-key"
TRITON_GRPC_KEY_HEADER = "triton-grpc-protocol-" + TRITON_KEY_HEADER  # Triton's prefix for gRPC metadata
TRITON_KEY_ENV = "OMNISTAGE_TRITON_KEY"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton config spelling, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class ModelContract:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = True
    # request parameters (Triton `parameters` of a request) the model understands, name -> type name
    parameters: dict[str, str] = field(default_factory=dict)

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)


# ---- sampling parameters shared by thinker and talker requests -------------------------------------------
SAMPLING_PARAMETERS = {
    "max_tokens": "int",
    "min_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "repetition_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "seed": "int",
    "ignore_eos": "bool",
    "stop_token_ids": "json",  # JSON list of ints
}

# ---- thinker: multimodal prompt in, text tokens (and the talker's conditioning) out -----------------------
THINKER = ModelContract(
    name="thinker",
    inputs=(
        # optional only so that `action=abort` requests, which carry no tensors, pass Triton's input check
        TensorSpec("input_ids", "TYPE_INT64", (-1,), optional=True),
        TensorSpec("pixel_values", "TYPE_UINT8", (-1, -1), optional=True),  # [patches, C*T*P*P] (models/pixels.py)
        TensorSpec("image_grid_thw", "TYPE_INT64", (-1, 3), optional=True),  # [images, 3]
        TensorSpec("input_features", "TYPE_FP32", (-1, -1, -1), optional=True),  # [audios, mels, frames]
        TensorSpec("feature_attention_mask", "TYPE_INT64", (-1, -1), optional=True),  # [audios, frames]
        TensorSpec("pixel_values_videos", "TYPE_UINT8", (-1, -1), optional=True),  # [patches, C*T*P*P]
        TensorSpec("video_grid_thw", "TYPE_INT64", (-1, 3), optional=True),  # [videos, 3]
        TensorSpec("video_second_per_grid", "TYPE_FP32", (-1,), optional=True),  # [videos] seconds per grid step
    ),
    outputs=(
        TensorSpec("token_ids", "TYPE_INT64", (-1,)),  # new reply tokens since the last response
        TensorSpec("text_rows", "TYPE_FP32", (-1, -1)),  # [n, D_thinker] input embeddings of those tokens (EOS excluded)
        # first response only, when the talker is wanted: the user turns' ids, their media rows, six special rows
        TensorSpec("talker_media_rows", "TYPE_FP32", (-1, -1)),  # [media rows, D] accept-layer hidden; absent if none
        TensorSpec("talker_user_is_mm", "TYPE_BOOL", (-1,)),  # [Lu]
        TensorSpec("talker_user_ids", "TYPE_INT64", (-1,)),  # [Lu]
        TensorSpec("talker_special_rows", "TYPE_FP32", (6, -1)),  # im_start, assistant, \n, tts_bos, tts_eos, tts_pad
        TensorSpec("prompt_tokens", "TYPE_INT64", (1,)),  # first response only
        TensorSpec("cached_tokens", "TYPE_INT64", (1,)),  # first response only: prompt tokens the prefix cache gave
        TensorSpec("finish_reason", "TYPE_STRING", (1,)),  # final response: "stop" | "length" | "abort"
    ),
    # use_audio_in_video: the video's audio track is interleaved with its frames (MRoPE positions)
    parameters={**SAMPLING_PARAMETERS, "export_talker": "bool", "use_audio_in_video": "bool", BLS_TRANSPORT: "string"},
)

# ---- talker: thinker conditioning in (start, then appends), codec frames out -------------------------------
# One talker stream is driven by several Triton requests sharing `session`:
#   action=start  : the prompt tensors + the first reply-token rows; streams `codes` until the utterance ends
#   action=append : more reply-token rows (`text_rows`, may be empty) and `text_end`; answered at once, empty
#   action=abort  : ends the session's stream with finish_reason "abort"; answered at once, empty
TALKER = ModelContract(
    name="talker",
    inputs=(
        TensorSpec("text_rows", "TYPE_FP32", (-1, -1), optional=True),
        # absent for a prompt without media: the talker looks up text rows itself
        TensorSpec("talker_media_rows", "TYPE_FP32", (-1, -1), optional=True),
        TensorSpec("talker_user_is_mm", "TYPE_BOOL", (-1,), optional=True),
        TensorSpec("talker_user_ids", "TYPE_INT64", (-1,), optional=True),
        TensorSpec("talker_special_rows", "TYPE_FP32", (6, -1), optional=True),
        TensorSpec("image_grid_thw", "TYPE_INT64", (-1, 3), optional=True),
        TensorSpec("audio_feature_lengths", "TYPE_INT64", (-1,), optional=True),
        TensorSpec("video_grid_thw", "TYPE_INT64", (-1, 3), optional=True),
        TensorSpec("video_second_per_grid", "TYPE_FP32", (-1,), optional=True),
    ),
    outputs=(
        TensorSpec("codes", "TYPE_INT64", (-1, CODE_GROUPS)),  # [frames, 16] new frames since the last response
        TensorSpec("finish_reason", "TYPE_STRING", (1,)),
    ),
    parameters={
        "session": "string",
        "action": "string",
        "text_end": "bool",
        "speaker": "string",
        **SAMPLING_PARAMETERS,  # max_tokens / min_tokens count codec frames here
        BLS_TRANSPORT: "string",
    },
)

# ---- code2wav: a stream's codec frames in, chunk by chunk; each chunk's final samples out -------------------
# A stream is a session whose carried state (K/V of the pre-transformer's last window, the last conv-context
# rows, the frame count) stays in the code2wav instance, so the chunks, concatenated, equal the full decode
# while only frames and samples cross. One chunk at a time per session, each answered with one response:
#   action=start  : the stream's first chunk (`codes`); opens the session
#   action=append : its next chunk, sent once the previous one's audio is back
#   end=true      : on the last chunk, which closes the session (an append may then carry no codes)
#   action=abort  : closes the session; a chunk in flight ends with no audio; answered at once, empty
# A start without a session is a stream of one chunk.
CODE2WAV = ModelContract(
    name="code2wav",
    inputs=(
        # optional only so that an abort, or an end with no frames left, passes Triton's input check
        TensorSpec("codes", "TYPE_INT64", (-1, CODE_GROUPS), optional=True),  # [new frames, 16]
    ),
    outputs=(
        TensorSpec("audio", "TYPE_FP32", (-1,)),  # 24 kHz mono samples that became final
    ),
    parameters={"session": "string", "action": "string", "end": "bool", BLS_TRANSPORT: "string"},
)

# ---- omni_ensemble: what users call -------------------------------------------------------------------------
OMNI = ModelContract(
    name="omni_ensemble",
    inputs=(TensorSpec("messages", "TYPE_STRING", (1,)),),  # OpenAI-style chat messages, JSON
    outputs=(
        TensorSpec("text", "TYPE_STRING", (1,)),  # text delta
        TensorSpec("token_ids", "TYPE_INT64", (-1,)),  # the delta's token ids
        TensorSpec("audio", "TYPE_FP32", (-1,)),  # audio chunk, 24 kHz mono float in [-1, 1]
        TensorSpec("finish_reason", "TYPE_STRING", (1,)),  # final response
        TensorSpec("usage", "TYPE_STRING", (1,)),  # final response: JSON usage
    ),
    parameters={
        "modalities": "string",  # "text", "audio" or "text,audio" (default)
        "speaker": "string",
        "use_audio_in_video": "bool",  # a video part's audio track goes in with its frames
        # "fixed" (default): the fewest Code2Wav chunks; "playback": chunks that keep audio played as it
        # arrives ahead of its playback (realtime sessions; core/chunking.py)
        "chunk_schedule": "string",
        **SAMPLING_PARAMETERS,
        # per-stage overrides, vLLM-Omni's sampling_params_list flattened: talker_<name>
        **{f"talker_{k}": v for k, v in SAMPLING_PARAMETERS.items()},
    },
)

CONTRACTS = {c.name: c for c in (THINKER, TALKER, CODE2WAV, OMNI)}
