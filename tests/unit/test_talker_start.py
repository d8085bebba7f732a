# A talker start names the user turns by token id and hands over only their media rows (stages/wire.py): what
# does not add up is a 400 before anything is looked up, since an id beyond the table would fault the device.
import re

import pytest
import torch

from omnistage.core.errors import BadRequestError
from omnistage.core.sampling import SamplingParams
from omnistage.stages.wire import talker_sequence

D, VOCAB = 8, 100


def start(**changes):
    ids = torch.tensor([5, 7, 9, 9, 11])
    inputs = {"talker_user_ids": ids, "talker_user_is_mm": torch.tensor([0, 0, 1, 1, 0], dtype=torch.bool),
              "talker_media_rows": torch.randn(2, D), "talker_special_rows": torch.randn(6, D),
              "text_rows": torch.randn(3, D)}  # fmt: skip
    inputs.update(changes)
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return talker_sequence("s", inputs, {"speaker": "a"}, SamplingParams(max_tokens=8), {"a": 1}, VOCAB)


def test_a_consistent_start_carries_its_media_rows():
    seq = start()
    assert seq.payload.cond.media_rows.shape == (2, D) and seq.payload.cond.user_ids.tolist() == [5, 7, 9, 9, 11]
    assert len(seq.payload.text) == 3


def test_a_start_without_media_needs_no_media_rows():
    seq = start(talker_user_is_mm=torch.zeros(5, dtype=torch.bool), talker_media_rows=None)
    assert seq.payload.cond.media_rows.shape == (0, D)


@pytest.mark.parametrize("changes, message", [
    ({"talker_media_rows": torch.randn(1, D)}, "talker_media_rows must be [2, 8]"),
    ({"talker_media_rows": None}, "talker_media_rows must be [2, 8]"),
    ({"talker_media_rows": torch.randn(2, D + 1)}, "talker_media_rows must be [2, 8]"),
    ({"talker_user_is_mm": torch.zeros(4, dtype=torch.bool)}, "talker_user_is_mm has 4 rows"),
    ({"talker_user_ids": torch.tensor([5, 7, 9, 9, VOCAB])}, "talker_user_ids must lie in [0, 100)"),
    ({"talker_user_ids": torch.tensor([5, -1, 9, 9, 11])}, "talker_user_ids must lie in [0, 100)"),
    ({"talker_user_ids": None}, "talker start is missing talker_user_ids"),
])  # fmt: skip
def test_an_inconsistent_start_is_a_bad_request(changes, message):
    with pytest.raises(BadRequestError, match=re.escape(message)):
        start(**changes)
