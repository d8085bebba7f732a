# A tiny Qwen3-Omni config for CPU tests: every token id (chat specials, tts_*, codec_*, speakers,
# multimodal placeholders) and the codec geometry (16 code groups x 2048, talker vocab 3072,
# 1920 samples per frame, sliding window 72) are the released model's; only widths and depths shrink.
# Returned as a plain dict because 5.17's sub-config __post_init__ does `Cls(**sub_config)` and
# breaks when handed config objects.

SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}

CHAT_IDS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,  # also the thinker's EOS
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
}

MM_IDS = {
    "audio_token_id": 151675,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "audio_start_token_id": 151669,
    "audio_end_token_id": 151670,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}

_HEAD_DIM = 16
# mrope_section must sum to head_dim / 2 (real: [24, 20, 20] for head_dim 128).
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "interleaved": True,
          "mrope_interleaved": True}


def _thinker(hidden: int) -> dict:
    text = dict(
        vocab_size=152064,  # real vocab: token ids up to 151675 are used
        hidden_size=hidden, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD_DIM,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rope_parameters=dict(_MROPE), tie_word_embeddings=False,
    )
    audio = dict(
        num_mel_bins=128,  # WhisperFeatureExtractor(feature_size=128) of the real processor
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        downsample_hidden_size=32, output_dim=hidden,
        n_window=50, n_window_infer=800, conv_chunksize=500, max_source_positions=1500,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2,  # real patch geometry
        out_hidden_size=hidden, num_position_embeddings=2304,
        # Real [8, 16, 24] feed thinker layers 0..2; here layers 0..1, so accept_hidden_layer=3 comes after.
        deepstack_visual_indexes=[0, 1],
    )
    return dict(
        text_config=text, audio_config=audio, vision_config=vision,
        position_id_per_seconds=13, seconds_per_chunk=2, user_token_id=872,
        tie_word_embeddings=False, **MM_IDS,
    )


def _talker(thinker_hidden: int) -> dict:
    hidden = 32  # the code predictor's hidden must equal the talker's: it consumes talker hidden states
    text = dict(
        vocab_size=3072,  # codec 2048 + 1024 specials
        hidden_size=hidden, intermediate_size=64,  # intermediate_size = width of text/hidden_projection
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=_HEAD_DIM,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        shared_expert_intermediate_size=32,  # undeclared field, but the MoE block reads it
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rope_parameters=dict(_MROPE), tie_word_embeddings=False,
    )
    code_predictor = dict(
        vocab_size=2048, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=_HEAD_DIM, num_code_groups=16,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )
    return dict(
        text_config=text, code_predictor_config=code_predictor,
        num_code_groups=16, thinker_hidden_size=thinker_hidden,
        accept_hidden_layer=3,  # index into hidden_states (0 = embeddings); real 24 of 48
        spatial_merge_size=2,  # undeclared field, read by the talker's rope index code
        position_id_per_seconds=13, seconds_per_chunk=2, speaker_id=dict(SPEAKERS),
        tie_word_embeddings=False, **CODEC_IDS, **MM_IDS,
    )


def _code2wav() -> dict:
    return dict(
        codebook_size=2048, num_quantizers=16,  # must equal the talker's num_code_groups
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=72, max_position_embeddings=8000,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],  # product 1920 samples per frame
        decoder_dim=64,  # divisible by 2 ** len(upsample_rates)
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def tiny_config_dict() -> dict:
    thinker_hidden = 64
    return dict(
        architectures=["Qwen3OmniMoeForConditionalGeneration"],
        thinker_config=_thinker(thinker_hidden),
        talker_config=_talker(thinker_hidden),
        code2wav_config=_code2wav(),
        enable_audio_output=True,
        **CHAT_IDS,
    )
