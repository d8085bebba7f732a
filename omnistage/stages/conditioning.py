# What the thinker hands the talker for one prompt, besides the reply rows: the talker's prompt is built
# from these rows (stages/talker.py), as transformers' generate() builds it.
from __future__ import annotations

from dataclasses import dataclass

import torch

# rows of a talker prompt after its user turn: the assistant header, 4 tts_pad, tts_bos and the first reply row
ASSISTANT_ROWS = 9


def user_positions(ids: torch.Tensor, im_start: int, user: int) -> torch.Tensor:
    """The positions of a prompt's user turns (ids [L], host), the rows the talker's prompt starts with: a
    position's turn is named by the token after the `<|im_start|>` before it, as generate() finds it."""
    pos = torch.arange(ids.numel())
    starts = torch.where(ids == im_start, pos, torch.full_like(pos, -1))
    role = ids[(torch.cummax(starts, 0).values.clamp_min(0) + 1).clamp_max(ids.numel() - 1)]
    return (role == user).nonzero().squeeze(1)


@dataclass
class TalkerConditioning:
    media_rows: torch.Tensor  # [user_is_mm.sum(), D] the accept layer's hidden states on the media rows
    user_is_mm: torch.Tensor  # [Lu] bool
    user_ids: torch.Tensor  # [Lu] long
    special_rows: torch.Tensor  # [6, D]: <|im_start|>, assistant, \n, tts_bos, tts_eos, tts_pad
