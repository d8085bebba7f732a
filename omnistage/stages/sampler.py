# Token selection for a batch of rows with per-request parameters. Logit processing follows
# transformers' generate() order (repetition penalty, suppressed tokens, min-length EOS ban, then
# temperature / top-k / top-p) so greedy results match it exactly.
from __future__ import annotations

import torch

from ..core.sampling import SamplingParams


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}  # per request, only for seeded requests
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)

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
        logits = logits.float()
        for i, (p, hist, ban) in enumerate(zip(params, histories, banned)):
            if hist and p.needs_history:
                self._penalise(logits[i], p, hist)
            if ban:
                logits[i, ban] = float("-inf")
        if suppress is not None:
            logits[:, suppress] = float("-inf")
        tokens = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self.draw(logits[i], p.temperature, p.top_k, p.top_p, self.generator(request_ids[i], p))
        return tokens

    @staticmethod
    def _penalise(row: torch.Tensor, p: SamplingParams, history: list[int]) -> None:
        ids = torch.tensor(history, device=row.device)
        if p.repetition_penalty != 1.0:
            uniq = ids.unique()
            score = row[uniq]
            row[uniq] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            uniq, counts = ids.unique(return_counts=True)
            row[uniq] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)

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
