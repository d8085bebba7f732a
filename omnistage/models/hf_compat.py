# Workarounds for transformers 5.17 bugs met when driving Qwen3OmniMoeForConditionalGeneration.generate().
import contextlib


@contextlib.contextmanager
def talker_audio_config_patch(model):
    # With audio *input* plus audio output, the talker's get_rope_index reads
    # `self.config.audio_config.n_window`, which Qwen3OmniMoeTalkerConfig lacks (AttributeError).
    # Lend it the thinker's audio config for the duration only, so it is never saved with the talker.
    talker = getattr(model, "talker", model)
    cfg = talker.config
    if "audio_config" in cfg.__dict__:
        yield
        return
    cfg.audio_config = model.config.thinker_config.audio_config
    try:
        yield
    finally:
        del cfg.audio_config
