# The talker's prompts as transformers' generate() builds them, from the thinker's conditioning: the user
# turn (media rows through hidden_projection; the rest, looked up in the thinker's embedding table, through
# text_projection), then 9 assistant rows (the
# header, tts_pad x4, tts_bos and the first reply row on the text side; the codec prefix with the speaker
# on the codec side, summed), with their MRoPE positions. Text-only prompts are built together in one pass.
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.scheduler import Sequence
from .conditioning import ASSISTANT_ROWS, TalkerConditioning
from .host_copy import to_device
from .mrope import MropeIndex


@dataclass
class TalkerPrompt:
    cond: TalkerConditioning
    speaker_id: int
    text: list[torch.Tensor] = field(default_factory=list)  # thinker rows [D] to speak, first one included
    text_end: bool = False  # no more rows will come
    image_grid_thw: torch.Tensor | None = None
    audio_feature_lengths: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    # MRoPE positions [3, L] and rope delta of a media prompt, derived at admission (PromptBuilder.rope_index,
    # on the caller's thread) so that the engine's steps do not derive them while others wait
    rope: tuple[torch.Tensor, int] | None = None

    @property
    def has_media(self) -> bool:
        return not (self.image_grid_thw is None and self.audio_feature_lengths is None and self.video_grid_thw is None)

    def append(self, rows: torch.Tensor | None, end: bool) -> None:
        if rows is not None and rows.numel():
            self.text.extend(rows.unbind(0))
        self.text_end = self.text_end or end


@dataclass
class PromptRows:
    """One talker prompt as rows to prefill, with what its decode steps need."""

    embeds: torch.Tensor  # [L, D]
    positions: torch.Tensor  # [3, L] MRoPE position ids, on the host
    rope_delta: int
    tts_eos: torch.Tensor  # [D]
    tts_pad: torch.Tensor  # [D]
    text_only: bool  # positions are 0..L-1 in every MRoPE section


class PromptBuilder:
    def __init__(self, model, config, text_embeddings: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 max_seq_len: int):  # fmt: skip
        tc = config.talker_config
        self.model, self.device, self.dtype = model, device, dtype
        self.text_embeddings = text_embeddings  # [vocab, D] the thinker's layer-0 table, on the device
        self.hidden_size = tc.text_config.hidden_size
        self.codec_prefix = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
        self.codec_suffix = [tc.codec_pad_id, tc.codec_bos_id]
        self.tts_pad_id = config.tts_pad_token_id
        self.positions = torch.arange(max_seq_len)  # host: a text-only prompt's are a prefix
        self.mrope = MropeIndex(model, config.thinker_config.audio_config.n_window)

    def rope_index(self, p: TalkerPrompt) -> tuple[torch.Tensor, int]:
        """MRoPE positions [3, L] and rope delta of a media prompt's rows (user turn and the 9 assistant rows).
        generate() hands the talker the grids but not use_audio_in_video: its positions count video and audio
        rows apart even where the thinker's interleave them."""
        ids = torch.cat([p.cond.user_ids.cpu(), torch.full((ASSISTANT_ROWS,), self.tts_pad_id)])
        return self.mrope(ids, _host(p.image_grid_thw), _host(p.video_grid_thw), False,
                          _host(p.audio_feature_lengths), _host(p.video_second_per_grid))  # fmt: skip

    def build(self, seqs: list[Sequence]) -> list[PromptRows]:
        """The talker prompt rows generate() builds (user turn: media rows through hidden_projection, the rest
        through text_projection; the assistant header + tts specials over the codec prefix: nothink, think
        bos/eos, speaker, pad, bos; the first reply row), for all prompts in one pass: every row the thinker
        sent goes to the device in one copy, the user turns' text rows are looked up there, the rows of each projection through it once (which row takes which is known on
        the host, so the device only gathers and scatters), and the 9 assistant rows of all prompts are
        summed in one op. Prompt by prompt that was ~15 small ops each: a 16-prompt step spent ~15 ms of
        host time on them on the H200, beside ~22 ms of kernels (perf/README.md). MRoPE positions: 0..L-1 in
        every section for a text-only prompt, get_rope_index's for one with media (derived at admission)."""
        t, n = self.model, len(seqs)
        conds = [s.payload.cond for s in seqs]
        lengths = [c.user_ids.numel() for c in conds]
        is_mm = torch.cat([c.user_is_mm.cpu() for c in conds])
        text_ids = torch.cat([c.user_ids.cpu() for c in conds])[~is_mm]
        firsts = [s.payload.text[0][None] for s in seqs]
        pieces = [c.media_rows for c in conds] + [c.special_rows for c in conds] + firsts
        if all(p.device.type == "cpu" for p in pieces):
            rows = to_device(torch.cat(pieces), self.device).to(self.dtype)  # one copy
        else:
            rows = torch.cat([to_device(p, self.device) for p in pieces]).to(self.dtype)
        media, tail = rows.split([rows.shape[0] - 7 * n, 7 * n])
        looked_up = self.text_embeddings.index_select(0, to_device(text_ids, self.device))
        text = t.text_projection(torch.cat([looked_up, tail]))  # the user turns' text rows, specials, firsts
        if media.shape[0]:
            users = torch.empty(is_mm.numel(), self.hidden_size, dtype=self.dtype, device=self.device)
            users.index_copy_(0, to_device(is_mm.nonzero().squeeze(1), self.device), t.hidden_projection(media))
            users.index_copy_(0, to_device((~is_mm).nonzero().squeeze(1), self.device), text[: text_ids.numel()])
        else:
            users = text[: text_ids.numel()]
        special, first_text = text[text_ids.numel() :].split([6 * n, n])
        special, first_text = special.view(n, 6, -1), first_text.view(n, 1, -1)
        assistant = self._assistant_rows(special, first_text, seqs)
        prompts = []
        for i, (seq, user, length) in enumerate(zip(seqs, users.split(lengths), lengths)):
            p = seq.payload
            if p.has_media:
                positions, delta = p.rope if p.rope is not None else self.rope_index(p)
            else:
                positions, delta = self.positions[: length + ASSISTANT_ROWS].expand(3, -1), 0
            embeds = torch.cat([user, assistant[i]])
            prompts.append(PromptRows(embeds, positions, delta, special[i, 4], special[i, 5], not p.has_media))
        return prompts

    def _assistant_rows(self, special: torch.Tensor, first_text: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The 9 rows after each user turn, [n, 9, D]: on the text side the header, 4 tts_pad, tts_bos and the
        first reply row; on the codec side nothing under the header, then the codec prefix with the speaker.
        special [n, 6, D] (projected header x3, tts bos/eos/pad), first_text [n, 1, D]."""
        header, tts_bos, tts_pad = special[:, :3], special[:, 3:4], special[:, 5:6]
        codec_ids = to_device([self.codec_prefix + [s.payload.speaker_id] + self.codec_suffix for s in seqs],
                              self.device)  # fmt: skip
        text_side = torch.cat([header, tts_pad.expand(-1, 4, -1), tts_bos, first_text], dim=1)
        codec_side = torch.cat([torch.zeros_like(header), self.model.get_input_embeddings()(codec_ids)], dim=1)
        return text_side + codec_side


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()
