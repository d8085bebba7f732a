# Offline Qwen3OmniMoeProcessor (tokenizer + Whisper features + PIL image patches + video patches, the
# patches as bytes: models/pixels.py) and the conversion of OpenAI-style chat messages into thinker inputs.
import contextlib
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import torch

from omnistage.core.errors import BadRequestError
from omnistage.models import media, video
from omnistage.models.pixels import pixel_table

# The released preprocessor_config.json (one merged file for audio and image); used where a
# checkpoint has none.
DEFAULT_PREPROCESSOR = {
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
    "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True,
    "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
_FEATURE_KEYS = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length", "padding_value",
                 "dither", "return_attention_mask")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_OUTPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "input_features",
                "feature_attention_mask", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")


def patches(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """frames [T, H, W, C] uint8 -> ([grid_t * grid_h * grid_w, C * temporal_patch * patch * patch] uint8, the
    grid): padded to whole temporal patches by repeating the last frame, cut into rows in merge order, as
    transformers' Qwen2-VL processors lay them out (models/pixels.py scales them on the encoder's device)."""
    tp, ps, ms = temporal_patch_size, patch_size, merge_size
    if frames.shape[0] % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)])
    t, h, w, c = frames.shape
    gt, gh, gw = t // tp, h // ps, w // ps
    x = torch.from_numpy(frames).reshape(gt, tp, gh // ms, ms, ps, gw // ms, ms, ps, c)
    return x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(gt * gh * gw, c * tp * ps * ps), [gt, gh, gw]


class VideoProcessor:
    """Sampled, resized frames (models/video.py) -> the vision encoder's patches, laid out as transformers'
    Qwen2VLVideoProcessor lays them out (which needs torchvision), as bytes."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, patch_size: int, merge_size: int, temporal_patch_size: int):
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size

    def __call__(self, videos, **_):
        from transformers import BatchFeature

        cut = [patches(frames, self.patch_size, self.merge_size, self.temporal_patch_size) for frames in videos]
        # one video per request (processor.py's check): no copy of its patches into a new tensor
        rows = [x for x, _ in cut]
        return BatchFeature({"pixel_values_videos": torch.cat(rows) if len(rows) > 1 else rows[0],
                             "video_grid_thw": torch.tensor([g for _, g in cut], dtype=torch.long)})  # fmt: skip


def image_processor(cfg: dict):
    """transformers' PIL image processor (smart_resize, bicubic) with the preprocessor config's settings, its
    patches left as bytes: do_rescale and do_normalize off, and cut without its float32 cast. Its rescale
    factor, mean and std stay set: pixels.pixel_table reads them."""
    from transformers import Qwen2VLImageProcessorPil

    class ImageProcessor(Qwen2VLImageProcessorPil):
        def patchify(self, image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int):
            # an image is a video of one frame: [C, H, W] -> that frame repeated to a temporal patch
            frame = np.ascontiguousarray(image.transpose(1, 2, 0))[None]
            x, (_, gh, gw) = patches(frame, patch_size, merge_size, temporal_patch_size)
            return x.numpy(), gh, gw

    # Pass `size` as a fresh dict: given min_pixels/max_pixels, 5.17 mutates the class-level default.
    return ImageProcessor(size={"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]},
                          patch_size=cfg["patch_size"], merge_size=cfg["merge_size"],
                          temporal_patch_size=cfg["temporal_patch_size"], image_mean=cfg["image_mean"],
                          image_std=cfg["image_std"], do_rescale=False, do_normalize=False)  # fmt: skip


def load_pixel_table(source) -> torch.Tensor:
    """The [C, 256] table that scales the pixel bytes of `source`'s processor (models/pixels.py)."""
    return pixel_table(image_processor(_read_preprocessor_config(_checkpoint_dir(source))))


@contextlib.contextmanager
def _allow_video_processor():
    # Without torchvision ProcessorMixin cannot even resolve BaseVideoProcessor for its class check
    # of the video_processor argument; skip the check for ours while constructing.
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if isinstance(arg, VideoProcessor) else original(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def _read_preprocessor_config(directory: Path | None) -> dict:
    cfg = dict(DEFAULT_PREPROCESSOR)
    path = directory / "preprocessor_config.json" if directory else None
    if path and path.is_file():
        cfg.update(json.loads(path.read_text()))
    return cfg


def _load_tokenizer(directory: Path | None):
    from omnistage.models.tokenizer import CHAT_TEMPLATE, EXTRA_SPECIAL_TOKENS, build_tokenizer

    has_files = directory is not None and any(
        (directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    if not has_files:
        return build_tokenizer()  # same vocabulary as the released model, built offline
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if any(getattr(tokenizer, name, None) is None for name in EXTRA_SPECIAL_TOKENS):
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, extra_special_tokens=dict(EXTRA_SPECIAL_TOKENS))
    # The processor-level template (chat_template.json, as in the released repo) knows media parts;
    # a tokenizer-level one may be the text-only Qwen3 template.
    processor_template = directory / "chat_template.json"
    if processor_template.is_file():
        tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
    elif not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _checkpoint_dir(source) -> Path | None:
    directory = None if str(source).startswith("dummy:") else Path(source)
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    return directory


def load_processor(source):
    """source: a checkpoint directory, or a `dummy:` source (built-in tokenizer, released defaults)."""
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor

    directory = _checkpoint_dir(source)
    cfg = _read_preprocessor_config(directory)
    feature_extractor = WhisperFeatureExtractor(**{k: cfg[k] for k in _FEATURE_KEYS})
    tokenizer = _load_tokenizer(directory)
    video_processor = VideoProcessor(cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"])
    with _allow_video_processor():
        processor = Qwen3OmniMoeProcessor(
            image_processor=image_processor(cfg), video_processor=video_processor,
            feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
        )
    processor.max_token_chars = max_token_chars(tokenizer)  # prepare_inputs' bound on a text's tokens
    processor.plain_text = plain_text_encoder(tokenizer)  # prepare_inputs' encoder of client texts
    return processor


def _convert_part(part, role: str, where: str, pending: list, audio_in_video: bool) -> dict:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequestError(f"{where}: a content part must be an object with a 'type'")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequestError(f"{where}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind not in ("image_url", "input_audio", "audio_url", "video_url"):
        raise BadRequestError(f"{where}: unsupported content part type {kind!r}")
    if role != "user":
        raise BadRequestError(f"{where}: {kind} parts are only allowed in user messages")
    if len(pending) >= media.LIMITS.max_media_items:
        raise BadRequestError(f"{where}: more than {media.LIMITS.max_media_items} media items")
    body = part.get(kind)
    if isinstance(body, str) and kind != "input_audio":
        body = {"url": body}
    if not isinstance(body, dict):
        raise BadRequestError(f"{where}: {kind} part needs a '{kind}' object")
    if kind == "image_url":
        _, raw = media.split_data_url(body.get("url"), where)
        pending.append(media.open_image(raw, where))
        return {"type": "image"}
    if kind == "video_url":
        if any(p.kind == "video" for p in pending):
            # the processor derives every video's time positions from one frame rate per request
            raise BadRequestError(f"{where}: one video per request")
        _, raw = media.split_data_url(body.get("url"), where)
        plan = video.plan(raw, where, audio_in_video)
        pending.append(media.PendingMedia("video", video.cost(plan) + len(raw),
                                          lambda: video.decode_frames(raw, plan, where), plan.sample_fps))  # fmt: skip
        if audio_in_video:  # its track takes the audio slot at the video's place in the prompt
            pending.append(media.PendingMedia("audio", 0, lambda: video.decode_audio(raw, where)))
        return {"type": "video"}
    if kind == "input_audio":
        raw = media.b64decode(body.get("data"), where)
        pending.append(media.open_audio(raw, body.get("format", "wav"), where))
    else:
        mime, raw = media.split_data_url(body.get("url"), where)
        pending.append(media.open_audio(raw, media.audio_format_from_mime(mime, where), where))
    return {"type": "audio"}


@contextlib.contextmanager
def _at(where: str):
    """A BadRequestError raised inside names the part `where` (e.g. messages[0].content[1]) as the field at
    fault, with OpenAI's `invalid_value` unless it has a code of its own, as the frontend's own media checks
    do; media.py and video.py write the part into the message only."""
    try:
        yield
    except BadRequestError as e:
        if e.param is None:
            e.param = where
            if "error_code" not in vars(e):
                e.error_code = "invalid_value"
        raise


def _decoded_at(where: str, pending: media.PendingMedia) -> media.PendingMedia:
    def decode():
        with _at(where):
            return pending.decode()

    return dataclasses.replace(pending, decode=decode)


def _convert_messages(messages, audio_in_video: bool = False) -> tuple[list, list, int]:
    """(conversation for the chat template, the media's PendingMedia in prompt order, characters of text)"""
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    conversation, pending, chars = [], [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequestError(f"{where}: must be an object")
        role = _ROLES.get(message.get("role"))
        if role is None:
            raise BadRequestError(f"{where}: unknown role {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str):
            conversation.append({"role": role, "content": content})
            chars += len(content)
            continue
        if not isinstance(content, list) or not content:
            raise BadRequestError(f"{where}: content must be a string or a non-empty list of parts")
        parts = []
        for j, part in enumerate(content):
            at, first = f"{where}.content[{j}]", len(pending)
            with _at(at):
                parts.append(_convert_part(part, role, at, pending, audio_in_video))
            pending[first:] = [_decoded_at(at, p) for p in pending[first:]]  # decoded later, still named
        chars += sum(len(p["text"]) for p in parts if p["type"] == "text")
        conversation.append({"role": role, "content": parts})
    return conversation, pending, chars


# Stands for the i-th client text while the template renders and the processor expands media placeholders:
# private-use characters, so neither the template nor the processor finds a control token in a client's text.
_TEXT_MARK = re.compile("\ue000(\\d+)\ue001")


def _mark_texts(conversation: list) -> tuple[list, list[str]]:
    """(the conversation with every text replaced by its mark, the texts in mark order)"""
    texts = []

    def mark(text: str) -> str:
        texts.append(text)
        return f"\ue000{len(texts) - 1}\ue001"

    marked = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            content = mark(content)
        else:
            content = [dict(p, text=mark(p["text"])) if p["type"] == "text" else p for p in content]
        marked.append(dict(message, content=content))
    return marked, texts


def plain_text_encoder(tokenizer):
    """A copy of the tokenizer's backend that reads special tokens as text. A copy, because that is a flag of
    the backend, which transformers sets on every call (split_special_tokens): omni_ensemble's request threads
    share the processor, and one thread's setting would leak into another's encoding of the template."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def _with_texts(processor, prompt: str, texts: list[str], ids: list[int]) -> list[int]:
    """The prompt's token ids with every client text encoded as plain text: only the template's own control
    tokens (and the processor's expanded media placeholders) are control tokens. ids: the processor's encoding
    of `prompt` (marks in place of the texts, media expanded). Each stretch of it between control tokens is
    one piece of `prompt` between them (the expansion adds only control tokens); a piece is re-encoded with
    its marks replaced by their texts and special tokens read as text (plain_text_encoder), so the text around a
    client's text encodes as it does in the template."""
    special = {i: t.content for i, t in processor.tokenizer.added_tokens_decoder.items() if t.special}
    split = "(" + "|".join(re.escape(t) for t in sorted(special.values(), key=len, reverse=True)) + ")"
    pieces = iter([p for p in re.split(split, prompt) if p and p not in special.values()])
    out, in_piece = [], False
    for token in ids:
        if token in special:
            out.append(token)
            in_piece = False
        elif not in_piece:
            in_piece = True
            text = _TEXT_MARK.sub(lambda m: texts[int(m.group(1))], next(pieces))
            out += processor.plain_text.encode(text, add_special_tokens=False).ids
    return out


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (byte-level BPE: one character per byte), so
    text of n characters is at least n / max_token_chars tokens."""
    return max(len(token) for token in tokenizer.get_vocab())


def prepare_inputs(processor, messages: list[dict], use_audio_in_video: bool = False) -> dict:
    """OpenAI chat messages -> {input_ids [1, L], attention_mask [1, L], and when present pixel_values
    [patches, C*T*P*P] uint8, image_grid_thw [n_img, 3], input_features [n_audio, 128, frames],
    feature_attention_mask [n_audio, frames], pixel_values_videos [patches, C*T*P*P] uint8, video_grid_thw [1, 3],
    video_second_per_grid [1]} as torch tensors, ready for the thinker. use_audio_in_video: a video's audio
    track is interleaved with its frames (as the processor and get_rope_index define).
    Before anything is decoded or tokenized in full: media headers are checked against the limits, text that
    cannot fit the context even at the tokenizer's longest token is refused, and the decoded media's bytes
    are reserved in the process's budget (held until the tensors are built)."""
    conversation, pending, chars = _convert_messages(messages, use_audio_in_video)
    if -(-chars // processor.max_token_chars) > media.LIMITS.max_prompt_tokens:
        raise BadRequestError(f"the messages hold {chars} characters of text, more than the context of "
                              f"{media.LIMITS.max_prompt_tokens} tokens can take", param="messages",
                              code="context_length_exceeded")  # fmt: skip
    with media.BUDGET.reserve(sum(p.cost for p in pending)):
        decoded = [(p.kind, p.decode()) for p in pending]
        images = [d for kind, d in decoded if kind == "image"]
        audios = [d for kind, d in decoded if kind == "audio"]
        videos = [d for kind, d in decoded if kind == "video"]
        fps = [p.fps for p in pending if p.kind == "video"]
        del decoded
        conversation, texts = _mark_texts(conversation)
        prompt = processor.tokenizer.apply_chat_template(
            conversation, chat_template=processor.chat_template, add_generation_prompt=True, tokenize=False)
        batch = processor(text=[prompt], images=images or None, audio=audios or None, videos=videos or None,
                          fps=fps[0] if fps else None, use_audio_in_video=use_audio_in_video, return_tensors="pt")
    out = {k: batch[k] for k in _OUTPUT_KEYS if k in batch}
    ids = torch.tensor([_with_texts(processor, prompt, texts, out["input_ids"][0].tolist())])
    out["input_ids"], out["attention_mask"] = ids, torch.ones_like(ids)
    if "video_second_per_grid" in out:
        out["video_second_per_grid"] = torch.as_tensor(out["video_second_per_grid"], dtype=torch.float32)
    return out
