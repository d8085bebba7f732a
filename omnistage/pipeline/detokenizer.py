# Incremental detokenization: text deltas from a growing list of token ids without re-decoding the whole
# reply each time, and without emitting half of a multi-byte character (the decoder yields U+FFFD for
# an incomplete UTF-8 sequence; such a tail is held back until the next token completes it).
from __future__ import annotations

class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this are already emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if not full or full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        # the ids just emitted become the decoding context of the next delta (spacing rules need it)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the reply."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
