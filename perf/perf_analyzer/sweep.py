# perf_analyzer over omni_ensemble and each stage, one concurrency level per run (2.51 refuses
# --request-count with several levels in one run), each run's --profile-export-file read by
# perf.pa_first_response (TTFT, time to first audio, req/s); all levels in one summary.json.
#
#   make perf-analyzer                               # the binary's two shared libraries (once)
#   python -m perf.perf_analyzer.sweep --url 127.0.0.1:8001 --out .run/pa [--models omni_ensemble thinker]
#
# The venv's perf_analyzer (tritonclient 2.51) needs libb64.so.0d (Debian's libb64-0d) and libcudart.so.12
# (the nvidia-cuda-runtime-cu12 wheel, which this module puts on LD_LIBRARY_PATH); on the GPU machine the
# perf_analyzer on PATH is used as it is. Workload W1 (perf/workloads.py): 18 reply tokens, 46 frames.
# Against a server that `serve` started, OMNISTAGE_TRITON_KEY must hold its Triton key (sent with -H).
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from omnistage.core.protocol import TRITON_GRPC_KEY_HEADER, TRITON_KEY_ENV
from perf.pa_first_response import summarize_export
from perf.perf_analyzer import make_inputs

HERE = Path(__file__).resolve().parent
MODELS = ("omni_ensemble", "thinker", "talker", "code2wav")
W1 = {"reply_tokens": 18, "frames": 46}


def _param(name: str, value) -> list[str]:
    kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "string"
    return ["--request-parameter", f"{name}:{str(value).lower() if kind == 'bool' else value}:{kind}"]


def model_args(model: str, inputs: Path, reply_tokens: int, frames: int) -> list[str]:
    """perf_analyzer arguments of one model: its input file and the parameters omni_ensemble would send it."""
    talker = {"max_tokens": frames, "min_tokens": frames, "ignore_eos": True, "temperature": "0"}
    if model == "omni_ensemble":
        params = {"modalities": "text,audio", "speaker": "ethan", "max_tokens": reply_tokens, "ignore_eos": True,
                  "temperature": "0", **{f"talker_{k}": v for k, v in talker.items()}}
        data = HERE / "omni_w1.json"
    elif model == "thinker":
        params = {"max_tokens": reply_tokens, "ignore_eos": True, "temperature": "0", "export_talker": True}
        data = HERE / "thinker_w1.json"
    elif model == "talker":
        params, data = {"speaker": "ethan", "text_end": True, **talker}, inputs / "talker_w1.json"
    elif model == "code2wav":
        params, data = {}, inputs / "code2wav_chunk.json"
    else:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    return ["-m", model, "--input-data", str(data), *[a for k, v in params.items() for a in _param(k, v)]]


def perf_analyzer() -> tuple[str, dict[str, str]]:
    """The binary and the environment it runs in."""
    binary = shutil.which("perf_analyzer", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))  # fmt: skip
    if binary is None:
        raise SystemExit("perf_analyzer not found (pip install tritonclient[all], or the Triton SDK)")
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime  # the wheel's libcudart.so.12, for a machine without the CUDA toolkit

        lib = str(Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    except ImportError:
        pass
    probe = subprocess.run([binary, "--version"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"{binary} does not start (run `make perf-analyzer`):\n{probe.stderr.strip()}")
    return binary, env


def check_server(url: str) -> None:
    """One short omni_ensemble request before any perf_analyzer run. Refused (a server locked with a Triton key
    it was not given), perf_analyzer 2.51 says only "Failed to maintain requested inference load" and never
    exits."""
    messages = np.array([json.dumps([{"role": "user", "content": "hi"}]).encode()], dtype=np.object_)
    try:
        make_inputs._stream(url, "omni_ensemble", {"messages": messages}, {"modalities": "text", "max_tokens": 1},
                            timeout=120)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - whatever keeps one request from being answered stops the sweep
        hint = (f"; set {TRITON_KEY_ENV} to the key the server was started with (docs/reliability.md#security)"
                if TRITON_GRPC_KEY_HEADER in str(e) else "")  # fmt: skip
        raise SystemExit(f"{url} did not answer a request: {e}{hint}") from None


def run_level(binary: str, env: dict, url: str, model: str, concurrency: int, requests: int, out: Path,
              inputs: Path, workload: dict) -> dict:  # fmt: skip
    export = out / f"pa_{model}_c{concurrency}.json"
    key = make_inputs.triton_key()
    auth = ["-H", f"{TRITON_GRPC_KEY_HEADER}:{key}"] if key else []
    cmd = [binary, "-i", "grpc", "--async", "--streaming", "-u", url, *auth,
           *model_args(model, inputs, workload["reply_tokens"], workload["frames"]),
           "--concurrency-range", str(concurrency), "--request-count", str(requests),
           "--profile-export-file", str(export)]  # fmt: skip
    print("$", " ".join(cmd).replace(key or "\0", "<key>"), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / f"pa_{model}_c{concurrency}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not export.exists() or export.stat().st_size == 0:  # killed while exporting: empty
        return {"model": model, "concurrency": concurrency, "error": (done.stdout + done.stderr)[-2000:]}
    (summary,) = summarize_export(json.loads(export.read_text()), "codes" if model == "talker" else "audio")
    return {"model": model, "concurrency": concurrency, **summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.perf_analyzer.sweep", description=__doc__)
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests-per-level", type=int, default=2, help="x concurrency, per run")
    ap.add_argument("--reply-tokens", type=int, default=W1["reply_tokens"])
    ap.add_argument("--frames", type=int, default=W1["frames"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=0, help="requests of a discarded run before each model's levels")
    ap.add_argument("--keep-exports", action="store_true", help="keep the profile exports (large: every output)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    binary, env = perf_analyzer()
    check_server(args.url)
    inputs = args.out / "inputs"
    if {"talker", "code2wav"} & set(args.models):  # model tensors: taken from this server
        make_inputs.stages(args.url, inputs, args.reply_tokens)
    workload = {"reply_tokens": args.reply_tokens, "frames": args.frames}
    rows = []
    for model in args.models:
        if args.warmup:
            (args.out / "warmup").mkdir(exist_ok=True)
            run_level(binary, env, args.url, model, 1, args.warmup, args.out / "warmup", inputs, workload)
        for c in args.concurrency:
            rows.append(run_level(binary, env, args.url, model, c, args.requests_per_level * c, args.out, inputs,
                                  workload))  # fmt: skip
            if not args.keep_exports:
                (args.out / f"pa_{model}_c{c}.json").unlink(missing_ok=True)
            r = rows[-1]
            print(f"  {model} c={c}: " + (f"error: {r['error'][-300:]}" if "error" in r else
                  f"{r['answered']}/{r['requests']} answered, {r['throughput_rps'] or 0:.3f} req/s, "
                  f"TTFT {(r['ttft_ms'] or {}).get('mean', float('nan')):.1f} ms, "
                  f"first audio {(r['ttfp_ms'] or {}).get('mean', float('nan')):.1f} ms"), flush=True)  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out / 'summary.json'}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
