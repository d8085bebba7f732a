# What the thinker hands the talker for one prompt, besides the reply rows: the talker's prompt is built
# from these rows (stages/talker.py), as transformers' generate() builds it.
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TalkerConditioning:
    user_rows: torch.Tensor  # [Lu, D] layer-0 embeddings, accept-layer hidden states on multimodal rows
    user_is_mm: torch.Tensor  # [Lu] bool
    user_ids: torch.Tensor  # [Lu] long
    special_rows: torch.Tensor  # [6, D]: <|im_start|>, assistant, \n, tts_bos, tts_eos, tts_pad
