# One engine step's prefills while the scheduler builds it (core/scheduler.py): which sequences prefill and
# how much of each one's prompt, under the step's budget of prompt tokens and rows. A prompt that prefills
# in one piece goes whole; a longer one goes in whole chunks of what the budget leaves, and its last tokens.
# While others decode, a long prompt's pieces grow in smaller units (piece_tokens) within a bound on what
# they attend: the piece a step must give the oldest such prompt is one unit, not one chunk, so a step
# beside running streams stays short however far into a long prompt its piece lies.
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .scheduler import Sequence


class PrefillStep:
    """The prefills of one step under construction: the prompt tokens and rows left to hand out."""

    def __init__(self, budget: int | None, rows: int, chunk_tokens: Callable[[Sequence], int],
                 attended_budget: int | None = None, piece_tokens: int | None = None):  # fmt: skip
        """attended_budget: the most (new token, attended position) pairs that the pieces of prompts that go
        in chunks may add up to, a piece of t tokens ending at position e counting t * e (None: no bound);
        piece_tokens: with that bound, the unit such pieces grow in (None: the prompt's chunk)."""
        self.budget = budget if budget is not None else 1 << 62
        self.attended = attended_budget if attended_budget is not None else 1 << 62
        self.piece_tokens = piece_tokens if attended_budget is not None else None
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
        what the budgets leave (one chunk when `first`, whatever the budgets), or all of its prompt's rest;
        a sequence given a piece earlier in the step has it extended. Returns whether it got one (admitted
        through `admit` first, for a waiting sequence)."""
        left = seq.prompt_len - seq.prefilled
        chunked = not self.one_piece(seq)
        if not chunked:
            piece = left
        elif first:
            piece = min(left, self._unit(seq))
        else:
            piece = self._largest_piece(seq, left)
        extend = any(seq is s for s in self.prefills)
        if (piece < 1 and chunked) or (self.full and not extend):
            return False  # (a prompt of unknown length, 0, is one piece: the runner prefills all of it)
        if admit is not None:
            admit(seq)
        seq.chunk = seq.chunk + piece if extend else piece
        seq.prefilled += piece
        self.budget -= piece
        if chunked:
            self.attended -= piece * seq.prefilled
        if not extend:
            self.prefills.append(seq)
        return True

    def _unit(self, seq: Sequence) -> int:
        chunk = self.chunk_tokens(seq)
        return chunk if self.piece_tokens is None else min(chunk, self.piece_tokens)

    def _largest_piece(self, seq: Sequence, left: int) -> int:
        """The most of seq's `left` prompt tokens that fit the budgets: whole units, or all that is left."""
        chunk, start = self._unit(seq), seq.prefilled

        def fits(n: int) -> bool:
            return n <= self.budget and n * (start + n) <= self.attended

        if fits(left):
            return left
        piece = 0
        while piece + chunk < left and fits(piece + chunk):
            piece += chunk
        return piece
