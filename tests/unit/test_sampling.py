import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams, sampling_from_parameters
from omnistage.stages.sampler import Sampler, _penalise


def test_parameters_are_coerced_from_triton_strings():
    p = sampling_from_parameters(
        {"max_tokens": "12", "temperature": "0.5", "ignore_eos": "true", "stop_token_ids": "[1, 2]", "talker_top_k": 3},
        SamplingParams(max_tokens=10),
    )  # fmt: skip
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop_token_ids, p.top_k) == (12, 0.5, True, (1, 2), 0)
    assert (
        sampling_from_parameters({"talker_top_k": 3}, SamplingParams(max_tokens=10), prefix="talker_").top_k == 3
    )


@pytest.mark.parametrize("params", [
    {"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"max_tokens": "x"},
    {"ignore_eos": "maybe"}, {"stop_token_ids": "[1, \"a\"]"}, {"min_tokens": 50, "max_tokens": 10}, {"seed": -3},
])  # fmt: skip
def test_bad_parameters_are_bad_requests(params):
    sampling_from_parameters({}, SamplingParams(max_tokens=10))  # the defaults alone are fine
    with pytest.raises(BadRequestError) as e:
        sampling_from_parameters(params, SamplingParams(max_tokens=10))
    assert e.value.param in params and e.value.error_code  # OpenAI's error object names the field at fault


def test_max_tokens_follows_vllms_context_rule():
    # given: taken whatever its size while prompt + max_tokens fits the context; beyond, a 400 naming both
    given = sampling_from_parameters({"max_tokens": 16384}, SamplingParams(max_tokens=10))
    assert given.fit_to_context(100, 16484).max_tokens == 16384
    with pytest.raises(BadRequestError, match=r"16384.*1024 tokens.*prompt has 30") as e:
        given.fit_to_context(30, 1024)
    assert (e.value.param, e.value.error_code) == ("max_tokens", "context_length_exceeded")
    # absent: the stage default, cut to the room the prompt leaves
    default = sampling_from_parameters({}, SamplingParams(max_tokens=512))
    assert default.fit_to_context(30, 1024).max_tokens == 512
    assert default.fit_to_context(900, 1024).max_tokens == 124
    with pytest.raises(BadRequestError, match="prompt has 1024 tokens") as e:
        default.fit_to_context(1024, 1024)
    assert e.value.param == "messages"


def test_vllm_spelling_of_top_k_off_is_accepted():
    assert sampling_from_parameters({"top_k": -1}, SamplingParams(max_tokens=10)).top_k == -1


def test_greedy_with_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    history = [[1, 2, 3], [], [7, 7, 9]]
    expected = logits.clone()
    for i, h in enumerate(history):
        if h:
            expected[i : i + 1] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([h]), expected[i : i + 1])
    params = [SamplingParams(repetition_penalty=1.3)] * 3
    got = Sampler("cpu").sample(logits.clone(), ["a", "b", "c"], params, history, [[], [], []])
    assert got.tolist() == expected.argmax(-1).tolist()


def test_banned_and_suppressed_tokens_are_never_picked():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 10
    logits[:, 5] = 9
    suppress = torch.zeros(10, dtype=torch.bool)
    suppress[5] = True
    got = Sampler("cpu").sample(logits, ["a", "b"], [SamplingParams()] * 2, [[], []], [[4], []], suppress=suppress)
    assert got[0] not in (4, 5) and got[1] == 4


def test_top_k_top_p_keep_the_same_tokens_as_transformers():
    torch.manual_seed(1)
    row = torch.randn(1, 40)
    warped = TopPLogitsWarper(0.7)(None, TopKLogitsWarper(10)(None, row.clone()))
    allowed = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())
    g = torch.Generator().manual_seed(0)
    picks = {int(Sampler.draw(row[0], 1.0, 10, 0.7, g)) for _ in range(300)}
    assert picks <= allowed and len(picks) > 1


def test_seeded_requests_are_reproducible():
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [int(Sampler("cpu").sample(logits.clone(), ["x"], [p], [[]], [[]])[0]) for _ in range(3)]
    assert len(set(a)) == 1


def test_batched_penalties_equal_each_row_penalised_alone():
    # rows with different penalties and histories (repeats, none), as one batch: each row equals transformers'
    # repetition penalty then presence / frequency applied to it alone
    torch.manual_seed(2)
    logits = torch.randn(5, 60) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(repetition_penalty=1.05)]  # fmt: skip
    history = [[1, 2, 3, 3], [4, 5], [7, 7, 9], [10, 10, 10, 11], []]
    expected = logits.clone()
    for i, (p, h) in enumerate(zip(params, history)):
        if h and p.repetition_penalty != 1.0:
            expected[i : i + 1] = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
                torch.tensor([h]), expected[i : i + 1]
            )
        for token in set(h):
            expected[i, token] -= p.presence_penalty + p.frequency_penalty * h.count(token)
    banned = [[], [], [], [], [0]]
    got = Sampler("cpu").sample(logits.clone(), list("abcde"), params, history, banned)
    expected[4, 0] = float("-inf")
    assert got.tolist() == expected.argmax(-1).tolist()
    penalised = logits.clone()
    _penalise(penalised, [0, 2, 3], [params[i] for i in (0, 2, 3)], [history[i] for i in (0, 2, 3)])
    torch.testing.assert_close(penalised[[0, 2, 3]], expected[[0, 2, 3]], rtol=0, atol=0)
    torch.testing.assert_close(penalised[[1, 4]], logits[[1, 4]], rtol=0, atol=0)
