# Token selection for a batch of rows with per-request parameters. Logit processing follows
# transformers' generate() order (repetition penalty, suppressed tokens, min-length EOS ban, then
# temperature / top-k / top-p) so greedy results match it exactly.
from __future__ import annotations

import torch

from ..core.sampling import SamplingParams
from .host_copy import to_device


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}  # per request, only for seeded requests
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._neg_inf: torch.Tensor | None = None

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator(device=self.device)
            g.manual_seed(params.seed)
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,  # [N, V]
        request_ids: list[str],
        params: list[SamplingParams],
        histories: list[list[int]],
        banned: list[list[int]],  # per row: token ids that must not be picked now (EOS before min_tokens...)
        suppress: torch.Tensor | None = None,  # [V] bool, always banned for this stage
    ) -> torch.Tensor:
        # Penalties and bans for the whole batch in a few kernels and one host-to-device copy each: a loop
        # per row cost a device sync per row (unique()) at every step of the talker, whose default
        # repetition penalty applies to greedy requests too.
        logits = logits.float()
        penalised = [i for i, (p, hist) in enumerate(zip(params, histories)) if hist and p.needs_history]
        if penalised:
            _penalise(logits, penalised, [params[i] for i in penalised], [histories[i] for i in penalised])
        ban_rows = [i for i, ban in enumerate(banned) for _ in ban]
        if ban_rows:
            cols = [t for ban in banned for t in ban]
            # a device-side -inf: a Python float would be copied to the device with the stream synchronised
            index = (to_device(ban_rows, logits.device), to_device(cols, logits.device))
            logits.index_put_(index, self._minus_inf(logits))
        if suppress is not None:  # masked_fill, not logits[:, suppress]: a boolean index syncs with the device
            logits.masked_fill_(suppress, float("-inf"))
        tokens = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self.draw(logits[i], p.temperature, p.top_k, p.top_p, self.generator(request_ids[i], p))
        return tokens

    def _minus_inf(self, like: torch.Tensor) -> torch.Tensor:
        if self._neg_inf is None or self._neg_inf.device != like.device or self._neg_inf.dtype != like.dtype:
            self._neg_inf = torch.full((), float("-inf"), dtype=like.dtype, device=like.device)  # a fill kernel
        return self._neg_inf

    @staticmethod
    def draw(row: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator):
        row = row.float() / temperature
        if top_k > 0:
            kth = torch.topk(row, min(top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[0]


def _penalise(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[list[int]]) -> None:
    """transformers' repetition penalty (each seen token once: negative scores times p, positive ones divided
    by p), then OpenAI's presence and frequency penalties (minus presence + frequency x count), on `rows`."""
    device, vocab = logits.device, logits.shape[1]
    owner = to_device([j for j, hist in enumerate(histories) for _ in hist], device)
    tokens = to_device([t for hist in histories for t in hist], device)
    ones = torch.ones(tokens.shape, device=device)
    counts = torch.zeros(len(rows), vocab, device=device).index_put_((owner, tokens), ones, accumulate=True)
    seen = counts > 0
    per_row = to_device([[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params], device)
    repetition, presence, frequency = per_row.unbind(1)
    repetition, presence, frequency = repetition[:, None], presence[:, None], frequency[:, None]
    index = to_device(rows, device)
    scores = logits[index]
    scores = torch.where(seen, torch.where(scores < 0, scores * repetition, scores / repetition), scores)
    scores = torch.where(seen, scores - (presence + frequency * counts), scores)
    logits[index] = scores
