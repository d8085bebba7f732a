# What the orchestrator reads off a prompt's token ids before any stage runs: its tokens per modality
# (usage, as OpenAI breaks it down) and the length of the talker's prompt, so that a spoken request whose
# talker cannot fit its context is a 400 before the thinker starts rather than an error half-way through
# the reply.
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sampling import SamplingParams, sampling_from_parameters
from ..stages.conditioning import ASSISTANT_ROWS, user_positions

MODALITIES = ("audio", "image", "video")


@dataclass(frozen=True)
class PromptTokens:
    """The special token ids of one checkpoint that say what a prompt position holds."""

    placeholders: dict[str, int]  # modality -> its placeholder token id (one per encoder output row)
    im_start: int
    user: int

    @classmethod
    def from_config(cls, config) -> "PromptTokens":
        t = config.thinker_config
        ids = {"audio": t.audio_token_id, "image": t.image_token_id, "video": t.video_token_id}
        return cls(ids, config.im_start_token_id, config.user_token_id)

    def by_modality(self, ids: torch.Tensor) -> dict[str, int]:
        """{"text", "audio", "image", "video"} -> how many of `ids` ([L]) are of it; text is everything that
        is not a media placeholder (markers, chat template and the messages' words)."""
        counts = {m: int((ids == self.placeholders[m]).sum()) for m in MODALITIES}
        return {"text": int(ids.numel()) - sum(counts.values()), **counts}

    def talker_prompt_rows(self, ids: torch.Tensor) -> int:
        """Rows of the talker's prompt for the thinker prompt `ids` ([L], host): its user turns' positions
        and the assistant rows."""
        return int(user_positions(ids, self.im_start, self.user).numel()) + ASSISTANT_ROWS


def check_contexts(ids: torch.Tensor, options, thinker_context: int, talker_context: int, tokens: PromptTokens) -> None:
    """Raises the context 400 a stage would raise for this prompt (ids [L]), the thinker's first, then for a
    spoken request the talker's: the tokens a request asks for must fit beside its prompt; without them, a
    stage cuts its default to the room left. The stages check again (their own contract); here it comes
    before the thinker starts, so a spoken reply never fails half-way for want of talker context."""
    thinker = sampling_from_parameters(options.thinker_parameters, SamplingParams())
    thinker.fit_to_context(int(ids.numel()), thinker_context)
    if options.want_audio:
        talker = sampling_from_parameters(options.talker_parameters, SamplingParams())
        # -1: the frame after the last one's
        talker.fit_to_context(tokens.talker_prompt_rows(ids), talker_context - 1, stage="talker")
