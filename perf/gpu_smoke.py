# GPU smoke run of the served pipeline (one device call): the tiny checkpoint on cuda (bf16) through a
# real tritonserver, then the full-size config with dummy bf16 weights, a single W1-like request and a
# burst of concurrent ones; stage step times from the metrics endpoint. Writes JSON to argv[1].
#
#   source .carry/device/env.sh && python -m perf.gpu_smoke $OUT/smoke.json
from __future__ import annotations

import json
import os
import queue
import re
import tarfile
import sys
import threading
import time
import urllib.request
from pathlib import Path

from omnistage.launch.render import default_spec, render_repository
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.launch.tritonserver import TritonServer
from tests.triton.omni_client import OmniStream

FULL_CONFIG = REPO_ROOT / "perf" / "qwen3_omni_30b_a3b_instruct.config.json"
W1 = {"temperature": "0", "max_tokens": 18, "ignore_eos": True, "talker_temperature": "0",
      "talker_max_tokens": 46, "talker_ignore_eos": True}  # fmt: skip
PROMPT = [{"role": "system", "content": "You are a text-to-speech engine. Speak the user's message exactly. " * 8},
          {"role": "user", "content": "The quick brown fox jumps over the lazy dog near the quiet river bank."}]  # fmt: skip


def serve(model: str, run_dir: Path, **overrides) -> TritonServer:
    spec = default_spec(model, "cuda")
    for name, params in overrides.items():
        spec[name].parameters.update(params)
    repo = render_repository(REPO_ROOT / "model_repository", run_dir / "model_repository", spec)
    # each stub's stacks (SIGUSR1, dump_stacks) go to its own file there; see omnistage/triton/logs.py
    env = dict(os.environ, OMNI_STACKS_DIR=str(run_dir / "stacks"))
    # SMOKE_TRITON_ARGS: extra tritonserver arguments, e.g. "--pinned-memory-pool-byte-size=0"
    extra = os.environ.get("SMOKE_TRITON_ARGS", "").split()
    server = TritonServer.on_free_ports(repo, run_dir, gpus=[0], env=env, extra_args=extra)
    t0 = time.time()
    server.start_and_wait(timeout=400)
    print(f"[smoke] {model} ready in {time.time() - t0:.1f}s", flush=True)
    return server


def stage_metrics(server) -> dict:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    out = {}
    for name in ("step_ms", "batch_size", "slots_in_use"):
        for stage in ("thinker", "talker"):
            m = re.findall(rf"^omni_{stage}_{name}{{[^}}]*}} (\S+)$", text, re.M)
            out[f"{stage}_{name}"] = [float(v) for v in m]
    return out


def timed(url, messages, params) -> dict:
    s = OmniStream(url, messages, params)
    try:
        r = s.run(timeout=60)
    except queue.Empty:  # hung: leave every stub's stacks in the server log for the report
        dump_stacks()
        return {"error": "no response for 60 s"}
    audio_t = [t for t, k in r.events if k == "audio"]
    text_t = [t for t, k in r.events if k == "text"]
    audio_s = len(r.waveform) / 24000
    return {"error": r.error, "ttft": text_t[0] if text_t else None, "ttfp": audio_t[0] if audio_t else None,
            "e2e": r.events[-1][0] if r.events else None, "audio_s": audio_s,
            "rtf": (audio_t[-1] / audio_s) if audio_t and audio_s else None, "usage": r.usage}  # fmt: skip


def burst(url, n) -> dict:
    results = [None] * n
    t0 = time.time()

    def one(i):
        results[i] = timed(url, PROMPT, W1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    ok = [r for r in results if r and not r["error"]]
    mean = lambda k: sum(r[k] for r in ok) / len(ok) if ok else None  # noqa: E731
    # omni_ensemble's per-request milestones (usage["timeline_ms"]), averaged: where first audio waits
    timelines = [r["usage"]["timeline_ms"] for r in ok if (r.get("usage") or {}).get("timeline_ms")]
    milestones = sorted({k for t in timelines for k in t}, key=lambda k: sum(t.get(k, 0) for t in timelines))
    mean_timeline = {k: round(sum(t[k] for t in timelines if k in t) / sum(k in t for t in timelines), 1)
                     for k in milestones}  # fmt: skip
    return {"n": n, "ok": len(ok), "wall_s": wall, "req_per_s": len(ok) / wall, "mean_ttfp": mean("ttfp"),
            "mean_rtf": mean("rtf"), "mean_e2e": mean("e2e"), "mean_timeline_ms": mean_timeline,
            "errors": [r["error"] for r in results if r and r["error"]][:3]}  # fmt: skip


def watch(server, stop: threading.Event) -> None:
    while not stop.wait(10):
        print("[smoke] metrics", json.dumps(stage_metrics(server)), flush=True)


def dump_stacks() -> None:
    """SIGUSR1 to every Python stub: faulthandler writes all their threads' stacks into the server log."""
    import subprocess

    subprocess.run(["pkill", "-USR1", "-f", "triton_python_backend_stub"], check=False)


def main(out: str, tiny_too: bool = False) -> None:
    report = {"note": "full-size Qwen3-Omni config, DUMMY random bf16 weights, thinker/talker decode as CUDA graphs"}
    run = Path("/tmp/smoke")
    if tiny_too:
        from omnistage.models.tiny_checkpoint import make_tiny_checkpoint
        from tests import oracle

        server = serve(str(make_tiny_checkpoint(run / "tiny")), run / "tiny_run")
        try:
            report["tiny_cuda"] = {kind: timed(server.grpc_url, oracle.messages(kind), dict(W1, max_tokens=6, talker_max_tokens=30))
                                   for kind in ("text", "image", "audio")}  # fmt: skip
        finally:
            server.stop()
        Path(out).write_text(json.dumps(report, indent=1))
    report["full"] = smoke_full(run / "full", Path(out).parent / "evidence.tar.gz")
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def smoke_full(run_dir: Path, evidence: Path) -> dict:
    """Single W1 requests, then bursts (SMOKE_BURSTS, default 16,64) on one server; stops at the first burst
    that fails and packs every stub's stacks and the server log (the evidence) into one tarball."""
    report = {}
    server = serve(f"dummy:{FULL_CONFIG}", run_dir, thinker={"max_seq_len": "1024"}, talker={"max_seq_len": "1024"})
    stop = threading.Event()
    threading.Thread(target=watch, args=(server, stop), daemon=True).start()
    try:
        report["single"] = [timed(server.grpc_url, PROMPT, W1) for _ in range(3)]
        report["metrics_after_single"] = stage_metrics(server)
        for n in [int(b) for b in os.environ.get("SMOKE_BURSTS", "16,64").split(",")]:
            report[f"burst_{n}"] = burst(server.grpc_url, n)
            print(json.dumps(report[f"burst_{n}"]), flush=True)
            if report[f"burst_{n}"]["ok"] < n:
                dump_stacks()
                time.sleep(3)
                break
            report[f"metrics_after_{n}"] = stage_metrics(server)
    finally:
        stop.set()
        print("\n".join(line for line in server.log_tail(200).splitlines() if not line.startswith(("|", "+"))))
        server.stop()
        with tarfile.open(evidence, "w:gz") as tar:
            for path in [*sorted(run_dir.glob("stacks/*")), *sorted(run_dir.glob("*.log"))]:
                tar.add(path, arcname=path.name)
    return report


if __name__ == "__main__":
    main(sys.argv[1])
