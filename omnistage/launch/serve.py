# One command for the whole service: render the model repository, start tritonserver, start the
# OpenAI frontend against it, and stop both (frontend first) on Ctrl-C / SIGTERM or when either dies.
#
#   python -m omnistage.launch.serve --model checkpoints/tiny --device cpu
#   python -m omnistage.launch.serve --profile deploy/overlays/reference_3gpu.yaml --model <ckpt>
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from omnistage.launch.process import ManagedProcess, ProcessFailed, port_in_use
from omnistage.launch.render import add_profile_args, render_repository, spec_from_args
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.core.protocol import TRITON_KEY_ENV
from omnistage.launch.tritonserver import TritonServer
from omnistage.models.checkpoint import speaker_names


class _Stop(Exception):
    pass


def _say(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m omnistage.launch.serve", description="serve Qwen3-Omni on Triton")
    ap.add_argument("--model", default=None, help="checkpoint dir, or dummy:<config.json> (default: the profile's)")
    add_profile_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address of the OpenAI API")
    ap.add_argument("--api-port", type=int, default=8091, help="the OpenAI API and the demo (default 8091)")
    ap.add_argument("--triton-host", default="127.0.0.1", help="address tritonserver binds (HTTP, gRPC, metrics)")
    ap.add_argument("--http-port", type=int, default=8000, help="Triton HTTP (default 8000)")
    ap.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC (default 8001)")
    ap.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics (default 8002)")
    ap.add_argument("--triton-open-inference", action="store_true",
                    help="let clients without the Triton key infer on Triton's ports (model control, shared "
                         "memory, trace and logging still need it; see docs/reliability.md)")
    ap.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".run", help="rendered repository and logs")
    ap.add_argument("--src", type=Path, default=REPO_ROOT / "model_repository", help="dir of <model>/1/model.py")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for all models to load")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM/Ctrl-C, seconds in-flight requests get to finish before they are cancelled")
    ap.add_argument("--probe-interval", type=float, default=1.0,
                    help="seconds between the frontend's probes of every model (0: off; see docs/reliability.md)")
    return ap.parse_args(argv)


def _check_model(model: str) -> None:
    path = Path(model.removeprefix("dummy:"))
    if model != "dummy:tiny" and not path.exists():  # dummy:tiny is the built-in tiny config
        raise SystemExit(f"--model {model}: {path} does not exist")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile, spec = spec_from_args(args)
    _check_model(args.model or profile.model)
    if port_in_use(args.api_port, args.host):
        raise SystemExit(f"port {args.api_port} on {args.host} is already in use")

    repo = render_repository(args.src, args.run_dir / "model_repository", spec)
    _say(f"[serve] rendered {', '.join(spec)} ({profile.platform}, {profile.sources[-1].name}) into {repo}")
    gpus = sorted({g for s in spec.values() for g in s.gpus}) if profile.platform == "cuda" else []
    triton = TritonServer(
        repo, args.run_dir, host=args.triton_host, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, gpus=gpus,
        # a fresh key per start unless the deployer gives one (several servers behind one frontend share it)
        api_key=os.environ.get(TRITON_KEY_ENV) or secrets.token_urlsafe(24), restrict_inference=not args.triton_open_inference,
    )
    frontend = ManagedProcess(
        "openai_frontend",
        [sys.executable, "-m", "openai_frontend", "--triton-url", triton.grpc_url, "--host", args.host,
         "--port", str(args.api_port), "--voices", ",".join(speaker_names(args.model or profile.model)),
         "--shutdown-timeout", str(args.drain_timeout),
         *(["--max-audio-seconds", str(seconds)]
           if (seconds := profile.stages["omni_ensemble"].media.get("max_audio_seconds")) else []),
         *(["--probe-interval", str(args.probe_interval)] if args.probe_interval > 0 else ["--no-stage-probes"])],
        env={**os.environ, TRITON_KEY_ENV: triton.api_key},
        log_path=args.run_dir / "openai_frontend.log",
        cwd=REPO_ROOT,  # `-m openai_frontend` resolves from the checkout even when not pip-installed
    )

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    # SIGTERM as well as SIGINT: a service manager or `kill` stops us the same way as Ctrl-C
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        _say(f"[serve] starting tritonserver (log: {triton.log_path})")
        triton.start()
        waited = triton.wait_ready(args.ready_timeout, progress=_say)
        _say(f"[serve] tritonserver ready in {waited:.1f}s: http {triton.http_url}, grpc {triton.grpc_url}, "
             f"metrics {triton.metrics_url}")
        _say(f"[serve] starting the OpenAI frontend (log: {frontend.log_path})")
        frontend.start()
        api = f"http://{args.host}:{args.api_port}"
        frontend.wait_http_ok(f"{api}/health", timeout=120, progress=_say)
        _say(f"[serve] ready: OpenAI API at {api}/v1 (Ctrl-C stops)")
        while triton.alive() and frontend.alive():
            time.sleep(0.5)
        dead = triton.process if not triton.alive() else frontend
        _say(f"[serve] {dead.name} exited with code {dead.poll()}; last log lines:\n{dead.log_tail()}")
        return 1
    except _Stop as stop:
        _say(f"[serve] {stop}: shutting down")
        return 0
    except ProcessFailed as failure:
        _say(f"[serve] {failure}")
        return 1
    finally:
        # a second Ctrl-C must not abort the shutdown half-way and leave tritonserver running
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # frontend first: it stops accepting and drains (finishes or, after --drain-timeout, cancels) its
        # requests, so that Triton then stops with nothing in flight
        if frontend.alive():
            _say(f"[serve] draining in-flight requests (up to {args.drain_timeout:.0f}s)")
        frontend.stop(grace=args.drain_timeout + 10)
        triton.stop()
        _say("[serve] stopped")


if __name__ == "__main__":
    sys.exit(main())
