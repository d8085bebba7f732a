# Where one decode step's GPU time goes: the thinker decode step and the talker frame, eager (graphs
# replay the same kernels), under torch.profiler, at batch 1 and 64 on the full-size config with dummy
# weights; and one prefill call of 1 and 16 prompts per stage, with its wall time next to its kernel time
# (wall far above kernels = host-bound); then the same decode steps as served (CUDA graphs): wall time
# per step beside the kernel time inside it, where the gap is host work and launch gaps. Writes the top
# kernels by CUDA time per case as JSON to argv[1], and with --trace-dir a Chrome trace of the graphed
# batch-1 steps (thinker token, talker frame). Code2Wav: a stream's first chunk (4 frames) and a 25-frame
# chunk with its carried state, at 1, 16 and 64 streams, with transformers' ops and then with the fused
# kernels, on the same weights. thinker_prefix: the thinker's chunk prefill as W1 makes it at 64 streams
# (1 / 16 / 32 prompts of 150 tokens whose first 112 come from the prefix cache), graphs captured.
# thinker_b1 / talker_parts: a lone request's steps (graphs captured) with the stage's experts and with
# each of --also-experts (lean_grouped_mm): the thinker's decode step, and the talker's frame beside its two
# parts (the LM step and the code predictor's 15 sub-steps), with every kernel each runs. thinker_long: the
# thinker's decode step at 64 short rows, alone and beside --long-rows rows of --long-tokens positions.
#
#   python -m perf.profile_steps out.json [--experts NAME] [--also-experts NAME ...] [--trace-dir DIR]
#                                         [--stages thinker thinker_prefix thinker_riders thinker_b1 talker talker_parts
#                                          talker_riders
#                                          thinker_long code2wav] [--long-tokens 30000 --long-rows 4]
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.core.sampling import SamplingParams
from omnistage.models import fused, gemv
from omnistage.models.checkpoint import load_config, load_stage, load_text_embeddings
from omnistage.stages.code2wav import Code2WavRunner
from omnistage.stages.talker import TalkerRunner
from omnistage.stages.thinker import ThinkerPrompt, ThinkerRunner
from perf.stage_timing import decode_times, free, release, running, talker_prompts, thinker_prompts, timed

BATCHES = (1, 64)
PREFILLS = (1, 16)  # 16: a cohort of W1 prompts in one prefill step
CODE2WAV_STREAMS = (1, 16, 64)


def top_kernels(fn, n: int | None = 15) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"cuda_ms": round(total / 1e3, 2), "kernels": sum(e.count for e in events),
            "top": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 3), "count": e.count}
                    for e in (events if n is None else events[:n])]}  # fmt: skip


def with_wall(fn, measure=top_kernels) -> dict:
    return dict(measure(fn), wall_ms=timed(fn, repeat=5))


def host_side(fn, repeat: int = 5) -> dict:
    """The host's time to queue one call (from an idle GPU, without waiting for it at the end) and the host
    syncs inside it (torch's sync debug mode): a sync before the last launch leaves the GPU idle while the
    host queues the rest."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return {"host_ms": round(sum(times) / repeat * 1e3, 2), "syncs": len(syncs), "sync_sites": sorted(set(syncs))}


def traced(path: str | None, fn) -> None:
    """A Chrome trace (host ops and kernels) of one call, gzipped, for chrome://tracing or Perfetto."""
    if path is None:
        return
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    subprocess.run(["gzip", "-f", path], check=False)


def graphed_decode(runner, seqs, stage: str, step: str, trace_dir: str | None) -> dict:
    """The served prefills and decode step (graphs captured): kernels inside them and their wall time."""
    runner.capture_graphs()
    name = f"{stage}_{step}"
    prefill = {f"{stage}_prefill_graphs_n{b}": v for b, v in prefill_profile(runner, seqs).items()}
    out, _ = decode_times(runner, seqs, 8, measure=with_wall, batches=BATCHES)
    release(runner, seqs)
    runner.prefill(seqs[:1])
    traced(trace_dir and os.path.join(trace_dir, f"{name}_graphs_b1.json"), lambda: runner.decode(seqs[:1]))
    release(runner, seqs)
    return prefill | {f"{name}_graphs_b{b}": v for b, v in out.items()}


def prefill_profile(runner, seqs, measure=None, sizes=PREFILLS) -> dict:
    """One prefill call of b prompts per size: its top kernels (CUDA time) and its wall time, to tell a
    prefill's cost per prompt from its cost per call."""
    measure = measure or top_kernels
    out = {}
    for b in sizes:
        release(runner, seqs)
        call = lambda b=b: runner.prefill(seqs[:b])  # noqa: E731
        out[b] = dict(measure(call), wall_ms=timed(call, repeat=2))
    release(runner, seqs)
    return out


def profile_stage(runner_cls, model, config, kw, seqs, stage: str, step: str, trace_dir: str | None) -> dict:
    """One stage: eager prefill and decode-step kernels, then a graphed runner on the same weights."""
    runner = runner_cls(model, config, **kw)
    out = {f"{stage}_prefill_n{b}": v for b, v in prefill_profile(runner, seqs).items()}
    decoded, _ = decode_times(runner, seqs, 8, measure=top_kernels, batches=BATCHES)
    out.update({f"{stage}_{step}_b{b}": v for b, v in decoded.items()})
    release(runner, seqs)
    del runner
    free()
    graphed = runner_cls(model, config, **dict(kw, cuda_graphs=True))
    out.update(graphed_decode(graphed, seqs, stage, step, trace_dir))
    del graphed
    free()
    return out


def profile_frame_parts(model, text_embeddings, config, kw, params, experts: str) -> dict:
    """One W1 sequence alone (batch 1, graphs captured, as served at concurrency 1): its frame split into the
    talker LM step that reads the last frame back and picks the next codebook 0 (`_advance`) and the code
    predictor's 15 sub-steps that complete the frame (`_complete_frames`), each with every kernel it runs
    and its wall time. A lone request's RTF is ~46 of these frames."""
    runner = TalkerRunner(model, config, text_embeddings, **dict(kw, cuda_graphs=True))
    runner.capture_graphs()
    seq = running(0, params, talker_prompts(config, 150, 1)[0])
    runner.prefill([seq])
    for _ in range(3):
        runner.decode([seq])

    @torch.inference_mode()  # as decode() runs its parts
    def advance():
        runner.slots[seq.slot].unfed = True  # _advance reads the last frame back; decode() would check this
        runner._advance([seq])

    @torch.inference_mode()
    def complete():
        runner._complete_frames([seq])

    parts = {"frame": lambda: runner.decode([seq]), "lm_step": advance, "code_predictor": complete}
    out = {f"talker_b1_{experts}_{name}": dict(with_wall(fn, lambda f: top_kernels(f, n=None)), **host_side(fn))
           for name, fn in parts.items()}  # fmt: skip
    release(runner, [seq])
    del runner
    return out


def profile_thinker_b1(model, config, kw, params, experts: str) -> dict:
    """A lone thinker decode step (graphs captured), as at concurrency 1: with the talker's frames it shares
    the GPU for the reply's first tokens."""
    runner = ThinkerRunner(model, config, **dict(kw, cuda_graphs=True))
    runner.capture_graphs()
    seq = running(0, params, thinker_prompts(config, 150, 1, True)[0])
    runner.prefill([seq])
    step = lambda: runner.decode([seq])  # noqa: E731
    out = {f"thinker_b1_{experts}_decode": dict(with_wall(step), **host_side(step))}
    release(runner, [seq])
    del runner
    return out


def profile_prefix_prefill(model, config, kw, params, sizes=(1, 16, 32)) -> dict:
    """The thinker's prefills as W1 makes them at 64 streams: 150-token prompts that share their first 112
    tokens (W1's TTS system prompt), so each prefills only its ~38-token suffix over the kept prefix
    (stages/chunk_prefill.py, graphs captured), for 1 / 16 / 32 prompts at once."""
    runner = ThinkerRunner(model, config, **dict(kw, cuda_graphs=True, max_prefills=max(sizes),
                                                 prefix_cache_bytes=2 << 30))  # fmt: skip
    runner.capture_graphs()
    base = thinker_prompts(config, 150, 1, True)[0]
    prompts = []
    for i in range(max(sizes)):
        ids = base.input_ids.clone()
        ids[112] = (int(ids[112]) + 1 + i) % 150000  # the suffix differs, the first 7 blocks are shared
        prompts.append(ThinkerPrompt(ids, export_talker=True))
    seqs = [running(i, params, p) for i, p in enumerate(prompts)]
    runner.prefill(seqs[:2])  # the shared blocks are kept from their second sighting on (core/prefix_index.py)
    release(runner, seqs)
    out = {f"thinker_prefix_prefill_graphs_n{b}": v for b, v in prefill_profile(runner, seqs, sizes=sizes).items()}
    out["thinker_prefix_hit_tokens"] = runner.prefix.hit_tokens
    del runner
    return out


def profile_riders(model, config, kw, params, decodes: int = 60, riders=(1, 2, 4)) -> dict:
    """A decode step of `decodes` W1-like rows with 1, 2 or 4 new W1 prompts whose system prompt is kept (as
    profile_prefix_prefill makes them) in the slots above: their chunk prefill and then the decode step, in
    turn, against their suffixes in the decode step's forward (ThinkerRunner.decode's riders), as served
    (graphs captured). What a step with new prompts saves when the experts are read once."""
    slots = decodes + max(riders)
    runner = ThinkerRunner(model, config, **dict(kw, max_slots=slots, cuda_graphs=True, max_prefills=max(riders),
                                                 prefix_cache_bytes=2 << 30))  # fmt: skip
    runner.capture_graphs()
    base = thinker_prompts(config, 150, 1, True)[0]

    def w1(i: int) -> ThinkerPrompt:
        ids = base.input_ids.clone()
        ids[112] = (int(ids[112]) + 1 + i) % 150000  # the suffix differs, the first 7 blocks are shared
        return ThinkerPrompt(ids, export_talker=True)

    streams = [running(i, params, w1(i)) for i in range(decodes)]
    runner.prefill(streams[:2])  # the shared blocks are kept from their second sighting on
    for first in range(2, decodes, 16):
        runner.prefill(streams[first : first + 16])
    out = {"thinker_riders_decode_alone": with_wall(lambda: runner.decode(streams))}
    fresh = iter(range(decodes, 1 << 30))  # each call's prompts new: their own blocks never kept

    def prompts(n: int) -> list:
        return [running(decodes + i, params, w1(next(fresh))) for i in range(n)]

    out.update(riders_apart_and_in_step(runner, streams, prompts, riders, "thinker_riders", "decode"))
    release(runner, streams)
    del runner
    return out


def profile_talker_riders(model, text_embeddings, config, kw, params, decodes: int = 60, riders=(1, 2, 4)) -> dict:
    """A talker frame of `decodes` W1-like streams with 1, 2 or 4 new W1 talker prompts in the slots above: their
    prefill (a forward and a code-predictor call for their frame 0) and then the frame, in turn, against their
    rows in the frame's forward and their frame 0 in its predictor call (TalkerRunner.decode's riders), as
    served (graphs captured)."""
    runner = TalkerRunner(model, config, text_embeddings, **dict(kw, max_slots=decodes + max(riders),
                                                                 cuda_graphs=True, max_prefills=16))  # fmt: skip
    runner.capture_graphs()
    prompts = talker_prompts(config, 150, decodes + max(riders))
    streams = [running(i, params, p) for i, p in enumerate(prompts[:decodes])]
    for first in range(0, decodes, 16):
        runner.prefill(streams[first : first + 16])
    runner.decode(streams)  # each stream's frame 0 read back from here on, as at W1 mid-reply
    out = {"talker_riders_frame_alone": with_wall(lambda: runner.decode(streams))}

    def new(n: int) -> list:
        return [running(decodes + i, params, prompts[decodes + i]) for i in range(n)]

    out.update(riders_apart_and_in_step(runner, streams, new, riders, "talker_riders", "frame"))
    release(runner, streams)
    del runner
    return out


def riders_apart_and_in_step(runner, streams, new, sizes, name: str, step: str) -> dict:
    """For each n of sizes, n new prompts (new(n), released after each call) prefilled and then the streams'
    step, against the prompts in the step's forward (the runner's decode riders); asserts that they rode."""
    out = {}
    for n in sizes:
        assert runner.riders(new(n)), "the prompts would not ride"

        def apart(n=n):
            seqs = new(n)
            runner.prefill(seqs)
            runner.decode(streams)
            release(runner, seqs)

        def joint(n=n):
            seqs = new(n)
            runner.decode(streams, seqs)
            release(runner, seqs)

        out[f"{name}_{n}_prefill_then_{step}"] = with_wall(apart)
        joined = runner.prompts_in_decode
        out[f"{name}_{n}_in_{step}"] = with_wall(joint)
        assert runner.prompts_in_decode > joined, f"no graph took them beside the {step}"
    return out


def profile_beside_long(model, config, kw, params, long_tokens: int, long_rows: int, short_rows: int = 64,
                        measure=None) -> dict:
    """The thinker's decode step as perf/paged_ab.py's mixed level runs it (graphs captured on CUDA):
    `short_rows` W1-like rows (150-token prompts) alone, then with `long_rows` rows of `long_tokens`
    positions beside them, prefilled in the scheduler's pieces. Its kernels and wall time with this process
    alone on the GPU: whether the long rows' attention, or the stages sharing the GPU, slows that step."""
    from omnistage.core.scheduler import Scheduler, Sequence
    from omnistage.stages.kv_budget import kv_bytes_per_token
    from omnistage.stages.long_prefill import CHUNK_TOKENS

    measure = measure or with_wall
    slots = short_rows + long_rows
    # a pool for these rows and their steps (the served one is the profile's budget)
    pool = kv_bytes_per_token(config.thinker_config.text_config, kw["dtype"]) * (
        short_rows * 512 + long_rows * (long_tokens + 1024))  # fmt: skip
    runner = ThinkerRunner(model, config, **dict(kw, max_slots=slots, max_seq_len=long_tokens + 1024,
                                                 kv_cache_bytes=pool, cuda_graphs=kw["device"].type == "cuda"))
    runner.capture_graphs()
    scheduler = Scheduler(slots, slots, max_prefill_tokens=CHUNK_TOKENS, blocks=runner.cache.pool)

    def admit(prompts: list[ThinkerPrompt]) -> list[Sequence]:
        """The prompts through the scheduler's pieces, up to each one's first token."""
        seqs = [Sequence(f"r{len(scheduler.running) + i}", params, p) for i, p in enumerate(prompts)]
        for seq in seqs:
            runner.validate(seq)
            scheduler.add(seq)
        while any(s.prefilling or not s.num_generated for s in seqs):
            batch = scheduler.schedule(runner.is_ready, runner.prompt_tokens, runner.kv_tokens,
                                       runner.chunk_tokens, runner.prefix_blocks)  # fmt: skip
            runner.prefill(batch.prefills)
        return seqs

    # a step runs every occupied row up to the highest: the short rows alone before the long ones come
    short = admit(thinker_prompts(config, 150, short_rows, True))
    out = {f"thinker_decode_{short_rows}_short": measure(lambda: runner.decode(short))}
    long = admit(thinker_prompts(config, long_tokens, long_rows, True))
    out[f"thinker_decode_{short_rows}_short_{long_rows}x{long_tokens}"] = measure(lambda: runner.decode(short + long))
    out.update(profile_pieces(runner, long[0], short + long[1:], long_tokens, measure))
    release(runner, short + long)
    del runner
    return out


def profile_pieces(runner, seq, decodes, long_tokens: int, measure) -> dict:
    """A long prompt's piece as the scheduler gives one beside decodes (one 128-token unit at 30,000
    positions, or more units further down), rewritten in place at seq's slot (the same K/V each time): its
    kernels alone, the piece's forward then the decode step of `decodes` (one sync at the end), and the
    piece in the decode step's forward, as the engine runs it: what the experts' second read costs."""
    from omnistage.core.scheduler import Sequence
    from omnistage.stages.media_rows import InputRows

    ids = seq.payload.input_ids

    def piece(start: int, n: int):
        rows = InputRows(runner._embed(ids[start : start + n]))
        return lambda: runner.long_prefill.run([(rows, seq.slot, start)])

    out = {}
    for n, at in ((128, long_tokens - 129), (128, long_tokens // 2), (512, long_tokens // 8)):
        out[f"thinker_piece_{n}_at_{at}"] = measure(piece(at, n))
    unit = piece(long_tokens - 129, 128)
    out["thinker_decode_beside"] = measure(lambda: runner.decode(decodes))
    out["thinker_piece_128_then_decode"] = measure(lambda: (unit(), runner.decode(decodes)))
    # the same piece as served: through the decode step's forward (ThinkerRunner.decode's riders)
    for n, end in ((128, long_tokens - 1), (512, long_tokens // 8 + 512)):
        rider = Sequence("rider", seq.params, seq.payload, slot=seq.slot)
        rider.prompt_len, rider.prefilled, rider.chunk = long_tokens, end, n
        out[f"thinker_decode_with_piece_{n}_at_{end - n}"] = measure(lambda rider=rider: runner.decode(decodes, [rider]))
    return out


def profile_code2wav(module, dev, dtype, fused: bool) -> dict:
    """Code2Wav forwards as the W1 chunk schedule makes them: first chunks (4 frames, no state) and
    25-frame chunks after 29 frames (full conv context), for 1/16/64 streams at once; then the same with
    the fused SnakeBeta/RMSNorm kernels and copy-free convs installed (same weights)."""
    runner = Code2WavRunner(module, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(0)

    def codes(n: int) -> torch.Tensor:
        return torch.randint(0, runner.codebook_size, (n, runner.num_quantizers), device=dev, generator=g)

    state = runner.decode([(codes(4), None)])[0][1]
    state = runner.decode([(codes(25), state)])[0][1]
    out, probe, wav = {}, (codes(25), state), {}
    for variant in ("torch", "fused") if fused else ("torch",):
        if variant == "fused":
            out["code2wav_fused_modules"] = sum(fused.install(module).values())
        wav[variant] = runner.decode([probe])[0][0]
        for b in CODE2WAV_STREAMS:
            first = [(codes(4), None)] * b
            later = [(codes(25), state)] * b
            out[f"code2wav_{variant}_first4_b{b}"] = with_wall(lambda first=first: runner.decode(first))
            out[f"code2wav_{variant}_chunk25_b{b}"] = with_wall(lambda later=later: runner.decode(later))
    if fused:  # the same chunk's audio both ways: bf16 rounding apart, they should agree closely
        out["code2wav_fused_vs_torch_max_abs"] = float((wav["fused"] - wav["torch"]).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="perf/qwen3_omni_30b_a3b_instruct.config.json")
    ap.add_argument("--experts", default="gather_or_grouped")  # the cuda profile's
    ap.add_argument("--also-experts", nargs="*", default=["lean_grouped_mm"], help="thinker_b1 / talker_parts again")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--no-fused", action="store_true", help="keep transformers' ops and projections")
    ap.add_argument("--stages", nargs="+", default=["thinker", "talker", "code2wav"])
    ap.add_argument("--long-tokens", type=int, default=30000, help="thinker_long: positions of each long row")
    ap.add_argument("--long-rows", type=int, default=4, help="thinker_long: long rows beside 64 short ones")
    args = ap.parse_args()
    source, dev, dtype = f"dummy:{args.config}", torch.device("cuda", 0), torch.bfloat16
    config = load_config(source)
    kw = dict(max_slots=max(BATCHES), max_seq_len=1024, device=dev, dtype=dtype, cuda_graphs=False)
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    report = {"weights": "dummy random bf16", "model": "full-size Qwen3-Omni-30B-A3B config", "experts": args.experts,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "gemv": gemv.enabled}  # fmt: skip

    def save():  # after each stage too: a run cut by its time limit keeps what it measured
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def load(stage, experts=args.experts):
        model = load_stage(source, stage, dtype, dev, experts_implementation=experts)
        counts = {} if args.no_fused else fused.install(model)
        report[f"{stage}_fused_norms"] = counts.get("fused_ops", 0)
        report[f"{stage}_merged_projections"] = counts.get("merged_projections", 0)
        return model

    if "thinker" in args.stages:
        # export_talker: the served path, which also builds the talker's conditioning per prompt
        seqs = [running(i, params, p) for i, p in enumerate(thinker_prompts(config, 150, max(BATCHES), True))]
        report.update(profile_stage(ThinkerRunner, load("thinker"), config, kw, seqs, "thinker", "decode",
                                    args.trace_dir))  # fmt: skip
        free()  # the thinker's weights, released with the call
        save()
    if "thinker_prefix" in args.stages:
        report.update(profile_prefix_prefill(load("thinker"), config, kw, params))
        free()
        save()
    if "thinker_riders" in args.stages:
        report.update(profile_riders(load("thinker"), config, kw, params))
        free()
        save()
    if "talker_riders" in args.stages:
        table = load_text_embeddings(source, dtype, dev)
        report.update(profile_talker_riders(load("talker"), table, config, kw, params))
        free()
        save()
    if "talker" in args.stages:
        seqs = [running(i, params, p) for i, p in enumerate(talker_prompts(config, 150, max(BATCHES)))]
        talker = functools.partial(TalkerRunner, text_embeddings=load_text_embeddings(source, dtype, dev))
        report.update(profile_stage(talker, load("talker"), config, kw, seqs, "talker", "frame",
                                    args.trace_dir))  # fmt: skip
        free()
        save()
    if "thinker_b1" in args.stages:
        for experts in dict.fromkeys([args.experts, *args.also_experts]):
            report.update(profile_thinker_b1(load("thinker", experts), config, kw, params, experts))
            free()
            save()
    if "talker_parts" in args.stages:
        for experts in dict.fromkeys([args.experts, *args.also_experts]):
            table = load_text_embeddings(source, dtype, dev)
            report.update(profile_frame_parts(load("talker", experts), table, config, kw, params, experts))
            free()
            save()
    if "thinker_long" in args.stages:
        report.update(profile_beside_long(load("thinker"), config, kw, params, args.long_tokens, args.long_rows))
        free()
        save()
    if "code2wav" in args.stages:
        module = load_stage(source, "code2wav", dtype, dev)
        report.update(profile_code2wav(module, dev, dtype, fused=not args.no_fused))
    save()
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
