# The code predictor: for a batch of frames, codebooks 1..15 from the talker's hidden state and
# codebook 0, in 15 lock-step sub-steps over a 16-position cache (the prefix is never re-run).
from __future__ import annotations

import torch

from ..models.layer_stack import run_layers
from .cuda_graphs import GraphBank, batch_buckets, bucket_for
from .host_copy import to_device
from .kv_cache import LockstepCache


class CodePredictor:
    def __init__(self, talker, device, dtype):
        self.cp = talker.code_predictor  # Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
        self.talker_embed = talker.get_input_embeddings()
        cfg = self.cp.config
        self.groups = cfg.num_code_groups
        self.layers, self.kv_heads, self.head_dim = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.device, self.dtype = device, dtype
        # the rotary angles of the loop's 17 positions, once: a sub-step slices them instead of running the
        # rotary embedding's ~9 kernels (same function of the same positions, so the same values)
        with torch.no_grad():  # (not inference_mode: callers outside it may use the table too)
            positions = torch.arange(self.groups + 1, device=device)[None]
            self.angles = self.cp.model.rotary_emb(torch.zeros(1, dtype=dtype, device=device), positions)  # [1, 17, D]

    def __call__(
        self, past_hidden: torch.Tensor, c0: torch.Tensor, pick, cache: LockstepCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """past_hidden [B, D] (talker's last normed hidden state), c0 [B] long; pick(step, logits [B, V]) -> [B]
        chooses codebook `step` (1..15). Returns codes [B, 16] and the sum of the 16 code embeddings [B, D],
        which is the talker's next input (before the text row is added)."""
        model = self.cp.model
        batch = c0.shape[0]
        if cache is None:
            cache = LockstepCache(
                self.layers, batch, self.kv_heads, self.groups, self.head_dim, self.dtype, self.device
            )
        first = self.talker_embed(c0)  # [B, D]
        embeds = [first]
        hidden = torch.stack([past_hidden.to(self.dtype), first], dim=1)  # [B, 2, D]
        codes = [c0]
        for step in range(1, self.groups):
            out = self._forward(model, hidden, cache)
            code = pick(step, self.cp.lm_head[step - 1](out[:, -1]))
            codes.append(code)
            embed = model.codec_embedding[step - 1](code)
            embeds.append(embed)
            hidden = embed[:, None]
        # one stacked sum, as generate() does, so the float rounding matches it
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)

    def _forward(self, model, hidden: torch.Tensor, cache: LockstepCache) -> torch.Tensor:
        span = slice(cache.length, cache.length + hidden.shape[1])  # [1, t, D] angles: every row shares them
        position_embeddings = tuple(a[:, span] for a in self.angles)
        # no mask: sdpa is causal for the 2-row prefill, and one row attends to everything cached
        out = run_layers(model.layers, hidden, model.norm, attention_mask=None, position_embeddings=position_embeddings,
                         past_key_values=cache)  # fmt: skip
        cache.advance(hidden.shape[1])
        return out


class StaticCodePredictor:
    """The same 15 sub-steps from static buffers, replayed as one CUDA graph per batch bucket. Residual
    codebooks are picked inside the graph: argmax for greedy rows, else top-k 50 / top-p 0.8 sampling
    (the reference's settings) by the Gumbel-max trick on the device's default generator, so sampled
    rows draw from a stream shared by the batch (a request's seed does not fix its residual codebooks).
    A batch of greedy rows only replays a graph without the sampling kernels (~27 per sub-step: a frame
    went from 3519 to 3110 kernels on the H200), and greedy is what W1 and most TTS requests ask for."""

    TOP_K, TOP_P = 50, 0.8

    def __init__(self, predictor: CodePredictor, max_rows: int, hidden_size: int, cuda_graphs: bool):
        self.p = predictor
        dev, dtype = predictor.device, predictor.dtype
        self.bank = GraphBank("code_predictor", dev, cuda_graphs)
        self.buckets = batch_buckets(max_rows) if self.bank.enabled else None
        self.past_hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=dev)
        self.c0 = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.greedy = torch.ones(max_rows, dtype=torch.bool, device=dev)
        self.codes = torch.zeros(max_rows, predictor.groups, dtype=torch.long, device=dev)
        self.codec_sum = torch.zeros(max_rows, hidden_size, dtype=dtype, device=dev)
        self.caches: dict[int, LockstepCache] = {}

    def __call__(self, past_hidden: torch.Tensor, c0: torch.Tensor, greedy: list[bool]):
        """As CodePredictor.__call__ for n rows; returns views into the static outputs (valid until the next call)."""
        n = c0.shape[0]
        rows = n if self.buckets is None else bucket_for(n, self.buckets)
        self.past_hidden[:n].copy_(past_hidden)
        self.c0[:n].copy_(c0)
        self.greedy[:n].copy_(to_device(greedy, self.greedy.device))
        sampled = not all(greedy)
        self.bank.run((rows, sampled), lambda: self._run(rows, sampled))
        return self.codes[:n], self.codec_sum[:n]

    def capture_all(self) -> None:
        if self.bank.enabled:
            keys = [(rows, sampled) for rows in self.buckets for sampled in (False, True)]
            self.bank.capture_all(keys, lambda key: lambda: self._run(*key))

    def _cache(self, rows: int) -> LockstepCache:
        if rows not in self.caches:
            p = self.p
            self.caches[rows] = LockstepCache(p.layers, rows, p.kv_heads, p.groups, p.head_dim, p.dtype, p.device)
        return self.caches[rows]

    def _run(self, rows: int, sampled: bool) -> None:
        greedy = self.greedy[:rows]

        def pick(step: int, logits: torch.Tensor) -> torch.Tensor:
            if not sampled:  # on the head's bf16 logits: the same maximum as in float32, one kernel less
                return logits.argmax(-1)
            logits = logits.float()
            return torch.where(greedy, logits.argmax(-1), _sample_top_k_top_p(logits, self.TOP_K, self.TOP_P))

        cache = self._cache(rows)
        cache.length = 0
        codes, codec_sum = self.p(self.past_hidden[:rows], self.c0[:rows], pick, cache)
        self.codes[:rows].copy_(codes)
        self.codec_sum[:rows].copy_(codec_sum)


def _sample_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] -> [B]: one draw per row at temperature 1, with no host sync (Gumbel-max over the kept set)."""
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
    logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-20, 1.0)))
    return (logits + gumbel).argmax(-1)
