# The code predictor: for a batch of frames, codebooks 1..15 from the talker's hidden state and
# codebook 0, in 15 lock-step sub-steps over a 16-position cache (the prefix is never re-run).
from __future__ import annotations

import torch

from .kv_cache import LockstepCache


class CodePredictor:
    def __init__(self, talker, device, dtype):
        self.cp = talker.code_predictor  # Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
        self.talker_embed = talker.get_input_embeddings()
        cfg = self.cp.config
        self.groups = cfg.num_code_groups
        self.layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.device, self.dtype = device, dtype

    def __call__(self, past_hidden: torch.Tensor, c0: torch.Tensor, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """past_hidden [B, D] (talker's last normed hidden state), c0 [B] long; pick(step, logits [B, V]) -> [B]
        chooses codebook `step` (1..15). Returns codes [B, 16] and the sum of the 16 code embeddings [B, D],
        which is the talker's next input (before the text row is added)."""
        model = self.cp.model
        batch = c0.shape[0]
        cache = LockstepCache(self.layers, batch, self.kv_heads, self.groups, self.head_dim, self.dtype, self.device)
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

    @staticmethod
    def _forward(model, hidden: torch.Tensor, cache: LockstepCache) -> torch.Tensor:
        t = hidden.shape[1]
        positions = torch.arange(cache.length, cache.length + t, device=hidden.device)[None].expand(hidden.shape[0], t)
        position_embeddings = model.rotary_emb(hidden, positions)
        for layer in model.layers:
            # no mask: sdpa is causal for the 2-row prefill, and one row attends to everything cached
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, past_key_values=cache)
        cache.advance(t)
        return model.norm(hidden)
