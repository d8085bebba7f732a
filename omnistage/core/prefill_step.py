# One engine step's prefills while the scheduler builds it (core/scheduler.py): which sequences prefill and
# how much of each one's prompt, under the step's budget of prompt tokens and rows. A prompt that prefills
# in one piece goes whole; a longer one goes in whole chunks of what the budget leaves, and its last tokens.
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .scheduler import Sequence


class PrefillStep:
    """The prefills of one step under construction: the prompt tokens and rows left to hand out."""

    def __init__(self, budget: int | None, rows: int, chunk_tokens: Callable[[Sequence], int]):
        self.budget = budget if budget is not None else 1 << 62
        self.rows, self.chunk_tokens = rows, chunk_tokens
        self.prefills: list[Sequence] = []

    @property
    def full(self) -> bool:
        return len(self.prefills) >= self.rows

    def one_piece(self, seq: Sequence) -> bool:
        return self.chunk_tokens(seq) >= seq.prompt_len

    def fits(self, tokens: int) -> bool:
        return not self.prefills or tokens <= self.budget

    def take(self, seq: Sequence, first: bool = False, admit: Callable[[Sequence], Sequence] | None = None) -> bool:
        """Gives seq its next piece: its whole prompt where it prefills in one piece, else whole chunks of
        what the budget leaves (one chunk when `first`, whatever the budget), and its prompt's last tokens;
        a sequence given a piece earlier in the step has it extended. Returns whether it got one (admitted
        through `admit` first, for a waiting sequence)."""
        left = seq.prompt_len - seq.prefilled
        if self.one_piece(seq):
            piece = left
        else:
            chunk = self.chunk_tokens(seq)
            piece = min(left, chunk if first else max(self.budget, 0) // chunk * chunk)
            if piece == 0 and left <= self.budget:
                piece = left  # its prompt's last tokens, less than a chunk
        extend = any(seq is s for s in self.prefills)
        if (piece < 1 and not self.one_piece(seq)) or (self.full and not extend):
            return False  # (a prompt of unknown length, 0, is one piece: the runner prefills all of it)
        if admit is not None:
            admit(seq)
        seq.chunk = seq.chunk + piece if extend else piece
        seq.prefilled += piece
        self.budget -= piece
        if not extend:
            self.prefills.append(seq)
        return True
