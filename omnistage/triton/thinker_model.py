# Triton glue of the thinker stage: request tensors in, ThinkerOutput tensors out (mapping in stages/wire).
from __future__ import annotations

from ..core.protocol import THINKER
from ..models.processor import load_pixel_table
from ..stages.thinker import ThinkerRunner
from ..stages.wire import thinker_defaults, thinker_response, thinker_sequence
from .stage_model import StageModel
from .tensors import input_tensors


class ThinkerModel(StageModel):
    STAGE = "thinker"

    def build_runner(self, model):
        return ThinkerRunner(model, self.config, max_slots=self.max_slots, max_seq_len=self.max_seq_len,
                             device=self.device, dtype=self.dtype, cuda_graphs=self.cuda_graphs,
                             max_prefills=self.max_prefills, kv_cache_bytes=self.kv_cache_bytes,
                             prefix_cache_bytes=int(self.params.get("prefix_cache_bytes") or 0),
                             pixel_table=load_pixel_table(self.params["model_path"]))  # fmt: skip

    def sequence_from(self, request, params: dict, request_id: str):
        inputs = input_tensors(request, THINKER)
        return thinker_sequence(request_id, inputs, params, self.sampling_defaults(thinker_defaults(self.max_seq_len)))

    def validates_aside(self, seq) -> bool:
        # the digests of a prompt's images or video take milliseconds (a 10 s video's tens of them), and Triton
        # hands this model its next request only when this one is in; a clip's features are too small to pay
        # for the thread hop
        p = seq.payload
        return p.pixel_values is not None or p.pixel_values_videos is not None

    def encode(self, output, finish_reason):
        return thinker_response(output, finish_reason)
