# A lone request's talker frame is queued without waiting for the device: its LM step (codebook 0 picked
# with suppressed ids and a banned EOS) and the code predictor's sub-steps run under torch's sync debug mode
# set to error. One sync inside the step would leave the GPU idle while the host queues the rest (on the
# H200 a boolean-mask sync cost a lone frame 7.7 against 6.4 ms without it). Needs a CUDA device: run on
# the GPU machine with TRITON_INTERPRET=0 (README.md, Tests).
import pytest
import torch

from omnistage.core.sampling import SamplingParams
from omnistage.models.checkpoint import load_config, load_stage, load_text_embeddings
from omnistage.stages.talker import TalkerPrompt, TalkerRunner
from omnistage.stages.conditioning import TalkerConditioning

from .test_stage_oracle import running

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_talker_frame_queues_without_a_sync(cuda_graphs):
    config = load_config("dummy:tiny")
    model = load_stage("dummy:tiny", "talker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    table = load_text_embeddings("dummy:tiny", torch.bfloat16, "cuda")
    runner = TalkerRunner(model, config, table, max_slots=4, max_seq_len=256, device="cuda", dtype=torch.bfloat16,
                          cuda_graphs=cuda_graphs)  # fmt: skip
    runner.capture_graphs()
    d = config.thinker_config.text_config.hidden_size
    cond = TalkerConditioning(torch.zeros(0, d), torch.zeros(12, dtype=torch.bool),
                              torch.randint(0, 1000, (12,)), torch.randn(6, d) * 0.02)  # fmt: skip
    prompt = TalkerPrompt(cond, 2302, list((torch.randn(8, d) * 0.02).unbind(0)), True)
    seq = running("a", SamplingParams(max_tokens=64, ignore_eos=True), prompt, 0)
    with torch.inference_mode():
        runner.prefill([seq])
        runner.decode([seq])
        torch.cuda.synchronize()
        runner.slots[seq.slot].unfed = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner._advance([seq])
            runner._complete_frames([seq])
        finally:
            torch.cuda.set_sync_debug_mode("default")
