# The thinker's prefix cache on the tiny checkpoint: prompts that share a system prompt get its K/V from the
# pool from the third one on (blocks are kept on their second sighting) and prefill only the rest, with
# generate()'s reply tokens and the same slot K/V and talker conditioning as a full prefill.
import pytest
import torch

from omnistage.core.prefix_index import BLOCK
from omnistage.core.sampling import SamplingParams
from omnistage.models.processor import prepare_inputs
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner

from .. import oracle
from .test_stage_oracle import run_thinker, running, slot_kv

REPLY = 6
LONG_SYSTEM = {"role": "system", "content": "You read the user's message aloud, word for word, and add nothing. " * 3}


def _prompt(processor, text):
    inputs = prepare_inputs(processor, [LONG_SYSTEM, {"role": "user", "content": [{"type": "text", "text": text}]}])
    return inputs, ThinkerPrompt(inputs["input_ids"][0], export_talker=True)


def _runner(hf_model, prefix_bytes):
    return ThinkerRunner(hf_model.thinker, hf_model.config, max_slots=4, max_seq_len=512, device="cpu",
                         dtype=torch.float32, prefix_cache_bytes=prefix_bytes)  # fmt: skip


@torch.inference_mode()
def test_prompts_sharing_a_system_prompt_prefill_only_the_rest_and_match_generate(hf_model, processor):
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    texts = ["Say hello!", "Read this out.", "Good morning to you all.", "Say hello!", "Say hello!"]
    for i, text in enumerate(texts):
        inputs, prompt = _prompt(processor, text)
        want_text, _, _ = oracle.generate(hf_model, inputs, REPLY, 2)
        hits_before = cached.prefix.hit_tokens
        got, _ = run_thinker(cached, running(f"c{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i % 4))
        ref, _ = run_thinker(plain, running(f"p{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i % 4))
        assert got.token_ids == want_text == ref.token_ids
        shared = cached.prefix.hit_tokens - hits_before
        assert (got.cached_tokens, ref.cached_tokens) == (shared, 0)  # each request's own count, for its usage
        # the system prompt's blocks are kept after the second prompt; the 1st prompt's own blocks after its
        # second sighting (the 4th), so the 5th takes all of them but its last token
        assert (shared > 0) == (i >= 2), (i, shared)
        length = prompt.input_ids.numel()
        assert (shared == (length - 1) // BLOCK * BLOCK) == (i == 4), (i, shared, length)
        slot = i % 4
        torch.testing.assert_close(slot_kv(cached.cache, slot, length), slot_kv(plain.cache, slot, length),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(got.text_rows, ref.text_rows)
        torch.testing.assert_close(got.talker.media_rows, ref.talker.media_rows)


@torch.inference_mode()
def test_a_step_of_several_prompts_with_kept_prefixes_pads_like_a_graph_bucket(hf_model, processor):
    """Two cached prompts of different suffix lengths in one step, padded to 4 rows x 32 tokens x 256 kv as a
    CUDA graph would run them, equal each prompt prefilled in full."""
    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    warm = [_prompt(processor, t)[1] for t in ("One.", "Two.")]
    for i, prompt in enumerate(warm):  # two sightings: the shared blocks are kept
        run_thinker(cached, running(f"w{i}", SamplingParams(max_tokens=1), prompt, slot=i))
    cached.chunk_prefill.row_buckets = [4]  # graph-style padding, eagerly
    prompts = [_prompt(processor, t)[1] for t in ("Please say hello to everyone here.", "Hi.")]
    seqs = [running(f"s{i}", SamplingParams(max_tokens=REPLY), p, slot=2 * i + 1) for i, p in enumerate(prompts)]
    hits_before = cached.prefix.hit_tokens
    got = cached.prefill(seqs)
    assert cached.prefix.hit_tokens > hits_before
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        ref = plain.prefill([running(f"r{i}", SamplingParams(max_tokens=REPLY), prompt, slot=seq.slot)])[0]
        assert got[i].output.token_ids == ref.output.token_ids
        n = prompt.input_ids.numel()
        torch.testing.assert_close(slot_kv(cached.cache, seq.slot, n), slot_kv(plain.cache, seq.slot, n),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("joined", [True, False], ids=["in_the_decode_forward", "forward_of_their_own"])
def test_prompts_with_a_kept_prefix_beside_a_running_stream_ride_its_decode_and_match_generate(hf_model, processor,
                                                                                               joined):  # fmt: skip
    """Two prompts whose system prompt is kept arrive while a stream decodes, and take the two slots below
    its that two finished requests freed: their suffixes go through the decode step's forward (one call of
    each layer's MLP for the decode rows and their tokens), or, where no shape is captured beside the decode
    (ChunkPrefill.joins), through a chunk prefill of their own first. Either way every reply is generate()'s
    and their slots hold the K/V of a full prefill."""
    from .test_chunked_prefill import decode_forwards, serve

    cached, plain = _runner(hf_model, 8 << 20), _runner(hf_model, 0)
    for i, text in enumerate(("One.", "Two.")):  # two sightings: the system prompt's blocks are kept
        seq = running(f"w{i}", SamplingParams(max_tokens=1), _prompt(processor, text)[1], slot=i)
        run_thinker(cached, seq)
        cached.release(seq)
    if not joined:
        cached.chunk_prefill.joins = lambda *shape: False
    steps = decode_forwards(cached)
    texts = {"x": "One more.", "y": "And another.", "stream": "Read this out.",
             "a": "Please say hello to everyone here.", "b": "Hi."}  # fmt: skip
    lengths = {"x": 1, "y": 1, "stream": 12}  # x and y (slots 0 and 1) end at their prefill
    inputs = {k: _prompt(processor, t)[0] for k, t in texts.items()}
    requests = {k: (k, SamplingParams(max_tokens=lengths.get(k, REPLY), ignore_eos=True),
                    ThinkerPrompt(inputs[k]["input_ids"][0])) for k in texts}  # fmt: skip
    hits_before = cached.prefix.hit_tokens
    got, log = serve(cached, 1024, [requests[k] for k in ("x", "y", "stream")], later=[requests["a"], requests["b"]])
    assert cached.prefix.hit_tokens > hits_before
    ridden = [(ids, mlp_calls) for ids, mlp_calls in steps if ids]
    assert sorted(i for ids, _ in ridden for i in ids) == ["a", "b"]
    assert cached.stats()["prompts_in_decode"] == (2 if joined else 0)
    assert all(len(mlp_calls) == (1 if joined else 2) for _, mlp_calls in ridden)
    for k, (_, params, prompt) in requests.items():
        assert got[k].token_ids == oracle.generate(hf_model, inputs[k], params.max_tokens, 2)[0], k
    for k in ("a", "b"):
        prompt = requests[k][2]
        ref = running(f"r{k}", SamplingParams(max_tokens=REPLY), prompt, slot=3)
        plain.prefill([ref])
        keys, values = log.kv[k]
        torch.testing.assert_close(torch.cat(keys + values), slot_kv(plain.cache, 3, prompt.input_ids.numel()),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        plain.release(ref)


def test_a_zero_budget_keeps_nothing(hf_model):
    runner = _runner(hf_model, 0)
    assert runner.prefix is None and runner.stats()["prefix_hit_tokens"] == runner.stats()["prefix_prompt_tokens"] == 0


@pytest.mark.gpu
@torch.inference_mode()
def test_chunk_prefill_graphs_equal_the_full_prefill_on_cuda(tiny_checkpoint, processor):
    """As served on CUDA (bf16, gather_or_grouped experts, graphs): a prompt whose system prompt comes from the pool
    leaves the K/V of a full prefill in its slot, within bf16 rounding."""
    from omnistage.models.checkpoint import load_config, load_stage

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    kw = dict(max_slots=4, max_seq_len=512, device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    cached = ThinkerRunner(model, config, prefix_cache_bytes=8 << 20, **kw)
    plain = ThinkerRunner(model, config, **kw)
    cached.capture_graphs()
    plain.capture_graphs()
    for i, text in enumerate(["One.", "Two.", "Say hello!"]):
        prompt = _prompt(processor, text)[1]
        cached.prefill([running(f"c{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i)])
        plain.prefill([running(f"p{i}", SamplingParams(max_tokens=REPLY), prompt, slot=i)])
    assert cached.prefix.hit_tokens > 0  # the third took the system prompt from the pool
    n = prompt.input_ids.numel()
    torch.testing.assert_close(slot_kv(cached.cache, 2, n), slot_kv(plain.cache, 2, n), rtol=0.05, atol=0.05)


def test_chunk_prefill_buckets_keep_every_padded_position_below_its_kv_length(hf_model):
    """With graphs' buckets (set by hand on the CPU): a step's padded tokens all land below its kv bucket,
    and a suffix that would not fit any bucket goes to the full prefill instead (fits() is False)."""
    runner = _runner(hf_model, 8 << 20)
    chunk = runner.chunk_prefill
    chunk.row_buckets = [1, 2, 4]
    assert chunk.shape_for(3, 20, 200) == (4, 32, 256)
    assert chunk.shape_for(1, 40, 200) == (1, 48, 256)
    assert chunk.shape_for(1, 50, 200) == (1, 64, 512)  # 200 + 64 padded tokens need the 512 bucket
    assert chunk.fits(4, 64, 448) and not chunk.fits(4, 64, 449)  # 449 + 64 > 512
    assert not chunk.fits(4, 65, 0) and not chunk.fits(5, 10, 0)  # too long a suffix, too many rows


def cuda_runners(tiny_checkpoint) -> tuple[ThinkerRunner, ThinkerRunner]:
    """As served on CUDA (bf16, the fused kernels): a thinker with its graphs captured and a prefix cache, and
    an eager one without, over one model."""
    from omnistage.models.checkpoint import load_config, load_stage

    config = load_config(str(tiny_checkpoint))
    model = load_stage(str(tiny_checkpoint), "thinker", dtype=torch.bfloat16, device="cuda",
                       experts_implementation="gather_or_grouped")  # fmt: skip
    kw = dict(max_slots=4, max_seq_len=512, device="cuda", dtype=torch.bfloat16)
    graphs = ThinkerRunner(model, config, cuda_graphs=True, prefix_cache_bytes=8 << 20, **kw)
    graphs.capture_graphs()
    return graphs, ThinkerRunner(model, config, **kw)


@pytest.mark.gpu
@torch.inference_mode()
def test_prompts_riding_a_decode_on_cuda_equal_their_eager_prefill(tiny_checkpoint, processor):
    """As served on CUDA (bf16, the fused kernels, graphs captured): two prompts with a kept system prompt
    that ride a stream's decode step replay a graph captured beside it, and leave the K/V of an eager
    prefill of each, within bf16 rounding; the stream's decode row is the one it takes alone."""
    from .test_chunked_prefill import assert_close_in_bf16

    graphs, eager = cuda_runners(tiny_checkpoint)
    for i, text in enumerate(("One.", "Two.")):  # two sightings: the system prompt's blocks are kept
        seq = running(f"w{i}", SamplingParams(max_tokens=1), _prompt(processor, text)[1], slot=i)
        graphs.prefill([seq])
        graphs.release(seq)
    stream = running("s", SamplingParams(max_tokens=64, ignore_eos=True), _prompt(processor, "Read this out.")[1], 2)
    alone = running("s", SamplingParams(max_tokens=64, ignore_eos=True), stream.payload, 2)
    graphs.prefill([stream])
    eager.prefill([alone])
    prompts = [running(k, SamplingParams(max_tokens=REPLY), _prompt(processor, t)[1], slot=i)
               for i, (k, t) in enumerate({"a": "Please say hello to everyone here.", "b": "Hi."}.items())]  # fmt: skip
    assert graphs.riders(prompts) == prompts
    decoded, *ridden = graphs.decode([stream], prompts)
    [want] = eager.decode([alone])  # the stream's row: the same logits in the joint forward as alone
    assert graphs.stats()["prompts_in_decode"] == 2 and decoded.seq is stream and want.output is not None
    assert_close_in_bf16(graphs.decoder.logits_out[2].float(), eager.decoder.logits_out[2].float())
    for seq, result in zip(prompts, ridden):
        assert result.seq is seq and result.output.cached_tokens > 0
        ref = running(f"e{seq.request_id}", SamplingParams(max_tokens=REPLY), seq.payload, slot=3)
        eager.prefill([ref])
        n = seq.payload.input_ids.numel()
        assert_close_in_bf16(slot_kv(graphs.cache, seq.slot, n), slot_kv(eager.cache, 3, n))
        eager.release(ref)
