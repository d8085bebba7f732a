# The context a request must fit, as vLLM bounds it: the checkpoint's max_position_embeddings, or the deploy
# profile's max_seq_len where that is lower; a prompt + max_tokens beyond it is a 400 naming both numbers.
import pytest
import torch

from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams
from omnistage.core.scheduler import Sequence
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner


def thinker(hf_model, max_seq_len):
    return ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=1, max_seq_len=max_seq_len, device="cpu",
                         dtype=torch.float32)  # fmt: skip


def validated(runner, tokens, **params):
    given = {"max_tokens_given": True} if "max_tokens" in params else {}
    seq = Sequence("r", SamplingParams(**params, **given), ThinkerPrompt(torch.full((tokens,), 1000)))
    runner.validate(seq)
    return seq.params


def test_the_context_is_the_checkpoints_or_the_profiles_cap_below_it(hf_model):
    checkpoint = hf_model.config.thinker_config.text_config.max_position_embeddings
    assert thinker(hf_model, 2 * checkpoint).context == checkpoint
    assert thinker(hf_model, checkpoint // 4).context == checkpoint // 4


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(hf_model):
    checkpoint = hf_model.config.thinker_config.text_config.max_position_embeddings
    runner = thinker(hf_model, 2 * checkpoint)  # a profile cap above the checkpoint's: the checkpoint's holds
    assert validated(runner, 100, max_tokens=checkpoint - 100).max_tokens == checkpoint - 100
    with pytest.raises(BadRequestError) as e:
        validated(runner, 100, max_tokens=checkpoint - 99)
    assert (e.value.param, e.value.error_code) == ("max_tokens", "context_length_exceeded")
    assert f"{checkpoint - 99}" in str(e.value) and f"{checkpoint} tokens" in str(e.value) and "100" in str(e.value)
    # absent, it is the rest of the context, bounded by the server's default
    assert validated(runner, 100).max_tokens == SamplingParams().max_tokens
    assert validated(runner, checkpoint - 10).max_tokens == 10
    with pytest.raises(BadRequestError) as e:
        validated(runner, checkpoint)
    assert (e.value.param, e.value.error_code) == ("messages", "context_length_exceeded")
