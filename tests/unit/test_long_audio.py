# A clip far longer than the audio encoder's windows (1 s conv chunks, 8 s attention windows: n_window and
# n_window_infer feature frames) and than Whisper's 30 s is processed in full: every feature frame is kept,
# the prompt holds the processor's count of audio tokens for all of it, and the stages give generate()'s text
# tokens and codec codes. The longest clip accepted is the profile's max_audio_seconds (600 s by default).
# Its prompt is longer than the media buffers: the thinker and the talker prefill it in pieces across steps
# (its audio encoded once, at the first piece), a short text stream decoding between them.
import base64

import numpy as np
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.long_prefill import CHUNK_TOKENS
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_chunked_prefill import RUNNER, serve
from .test_stage_oracle import FRAMES, REPLY

SECONDS = 90


def test_90_second_clip_is_processed_in_full_and_matches_generate(hf_model, processor):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    # speech-like: a tone whose pitch wanders, so every second differs from the others
    t = np.arange(SECONDS * 16000) / 16000
    clip = np.sin(2 * np.pi * (200 + 80 * np.sin(t / 3)) * t) * (0.5 + 0.4 * np.sin(t * 1.7))
    pcm = (clip * 12000).astype("<i2").tobytes()
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(pcm).decode(), "format": "pcm"}}
    messages = [oracle.SYSTEM, {"role": "user", "content": [part, {"type": "text", "text": "What was said?"}]}]
    inputs = prepare_inputs(processor, messages)

    assert inputs["feature_attention_mask"].sum().item() == SECONDS * 100  # 10 ms hop: no frame dropped
    audio_tokens = int((inputs["input_ids"] == hf_model.config.thinker_config.audio_token_id).sum())
    assert audio_tokens == int(_get_feat_extract_output_lengths(torch.tensor(SECONDS * 100)))
    assert audio_tokens > 2 * int(_get_feat_extract_output_lengths(torch.tensor(30 * 100)))  # not cut at 30 s

    want_text, want_codes, _ = oracle.generate(hf_model, inputs, REPLY, FRAMES)
    short = prepare_inputs(processor, oracle.messages("text"))
    thinker = ThinkerRunner(hf_model.thinker, hf_model.config, **RUNNER)
    encoded = []
    rows = thinker.media.rows
    thinker.media.rows = lambda prompts, starts: encoded.append(len(prompts)) or rows(prompts, starts)
    prompt = ThinkerPrompt(inputs["input_ids"][0], input_features=inputs["input_features"],
                           feature_attention_mask=inputs["feature_attention_mask"], export_talker=True)
    got, steps = serve(thinker, CHUNK_TOKENS, [
        ("short", SamplingParams(max_tokens=3 * REPLY, ignore_eos=True), ThinkerPrompt(short["input_ids"][0])),
        ("clip", SamplingParams(max_tokens=REPLY, ignore_eos=True), prompt),
    ])  # fmt: skip
    n = inputs["input_ids"].shape[1]
    assert steps.pieces("clip") == [(a, min(a + CHUNK_TOKENS, n)) for a in range(0, n, CHUNK_TOKENS)]
    assert len(steps.pieces("clip")) == 3 and steps.decodes_between_pieces("clip", "short") == [1, 1]
    assert encoded == [1]  # the clip's audio, once
    assert got["clip"].token_ids == want_text
    assert got["short"].token_ids == oracle.generate(hf_model, short, 3 * REPLY, FRAMES)[0]

    talker = TalkerRunner(hf_model.talker, hf_model.config, hf_model.thinker.get_input_embeddings().weight, **RUNNER)
    out = got["clip"]
    tp = TalkerPrompt(out.talker, 2302, list(out.text_rows.unbind(0)), True, None, inputs["feature_attention_mask"].sum(-1))
    codes, steps = serve(talker, CHUNK_TOKENS, [("clip", SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), tp)])
    assert len(steps.pieces("clip")) == 3
    assert torch.equal(codes["clip"].codes, want_codes)
