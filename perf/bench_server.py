# tritonserver + the OpenAI frontend for a benchmark, like `python -m omnistage.launch.serve` but with
# deployment overrides (serve has no flag for the engines' max_seq_len / max_batch_size) and its own run
# dir, so that it never re-renders the repository of a server started by `make serve`.
#
#   python -m perf.bench_server --model checkpoints/tiny --device cpu --max-seq-len 1024 \
#       --http-port 18200 --grpc-port 18201 --metrics-port 18202 --api-port 18291
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omnistage.launch.process import ManagedProcess, port_in_use
from omnistage.launch.render import default_spec, render_repository, set_ensemble_contexts
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.launch.tritonserver import TritonServer

ENGINE_STAGES = ("thinker", "talker")  # the stages with a KV cache: max_seq_len / max_batch_size apply


def bench_spec(
    model: str,
    device: str,
    engine: dict[str, str] | None = None,
    stages: dict[str, dict[str, str]] | None = None,
    instances: dict[str, int] | None = None,
) -> dict:
    """default_spec with `engine` parameters set on thinker and talker, `stages` per model, and instance
    counts for the model that can have several (omni_ensemble: thinker, talker and code2wav sessions are
    pinned, their replicas are separate models)."""
    spec = default_spec(model, device)
    for name, count in (instances or {}).items():
        if name != "omni_ensemble":
            raise ValueError(f"instances: {name} cannot have several instances (only omni_ensemble)")
        spec[name].instances = count
    for name in ENGINE_STAGES:
        spec[name].parameters.update({k: str(v) for k, v in (engine or {}).items()})
    for name, params in (stages or {}).items():
        spec[name].parameters.update({k: str(v) for k, v in params.items()})
    set_ensemble_contexts(spec)  # the ensemble checks prompts against the contexts the stages now have
    return spec


class BenchServer:
    def __init__(
        self,
        model: str,
        device: str,
        run_dir: Path,
        *,
        engine: dict | None = None,
        stages: dict | None = None,
        instances: dict | None = None,
        host: str = "127.0.0.1",
        http_port: int = 18200,
        grpc_port: int = 18201,
        metrics_port: int = 18202,
        api_port: int = 18291,
    ):
        self.spec = bench_spec(model, device, engine, stages, instances)
        self.run_dir, self.host, self.api_port = Path(run_dir), host, api_port
        repo = render_repository(REPO_ROOT / "model_repository", self.run_dir / "model_repository", self.spec)
        gpus = sorted({g for s in self.spec.values() for g in s.gpus}) if device == "cuda" else []
        self.triton = TritonServer(
            repo,
            self.run_dir,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            gpus=gpus,
            # PERF_TRITON_ARGS: extra tritonserver arguments, e.g. "--pinned-memory-pool-byte-size=0"
            extra_args=os.environ.get("PERF_TRITON_ARGS", "").split(),
        )
        self.frontend = ManagedProcess(
            "openai_frontend",
            [
                sys.executable,
                "-m",
                "openai_frontend",
                "--triton-url",
                self.triton.grpc_url,
                "--host",
                host,
                "--port",
                str(api_port),
                "--log-level",
                "warning",
            ],  # no access log line per request
            env=None,
            log_path=self.run_dir / "openai_frontend.log",
            cwd=REPO_ROOT,
        )

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    def start(self, ready_timeout: float, progress: Callable[[str], None] = print) -> float:
        """Starts both; returns seconds until tritonserver was ready. Raises ProcessFailed on failure."""
        if port_in_use(self.api_port, self.host):
            raise RuntimeError(f"port {self.api_port} on {self.host} is already in use")
        t0 = time.monotonic()
        self.triton.start()
        ready = self.triton.wait_ready(ready_timeout, progress=progress)
        self.frontend.start()
        self.frontend.wait_http_ok(
            f"{self.api_url}/health", timeout=max(30.0, ready_timeout - ready), progress=progress
        )
        progress(
            f"[bench_server] ready after {time.monotonic() - t0:.1f}s: {self.api_url}/v1, grpc {self.triton.grpc_url}"
        )
        return ready

    def alive(self) -> bool:
        return self.triton.alive() and self.frontend.alive()

    def log_tail(self, lines: int = 80) -> str:
        return (
            f"==== tritonserver ({self.triton.log_path}) ====\n{self.triton.log_tail(lines)}\n"
            f"==== openai_frontend ({self.frontend.log_path}) ====\n{self.frontend.log_tail(lines // 2)}\n"
        )

    def stop(self) -> None:
        self.frontend.stop(grace=5)
        self.triton.stop()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_server", description=__doc__)
    ap.add_argument("--model", required=True, help="checkpoint dir, or dummy:<config.json>")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--max-seq-len", type=int, help="thinker and talker KV length (default: render's)")
    ap.add_argument("--max-batch-size", type=int, help="thinker and talker slots (default: render's)")
    ap.add_argument(
        "--set",
        type=stage_setting,
        action="append",
        default=[],
        metavar="MODEL.KEY=VALUE",
        help="any config parameter, e.g. code2wav.max_batch_windows=32",
    )
    ap.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".run" / "perf")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=18200)
    ap.add_argument("--grpc-port", type=int, default=18201)
    ap.add_argument("--metrics-port", type=int, default=18202)
    ap.add_argument("--api-port", type=int, default=18291)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    return ap.parse_args(argv)


def stage_setting(text: str) -> tuple[str, str, str]:
    """argparse type of --set MODEL.KEY=VALUE: (model, key, value)."""
    key, eq, value = text.partition("=")
    model, dot, name = key.partition(".")
    if not (eq and dot and model and name):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL.KEY=VALUE")
    return model, name, value


def by_model(settings: list[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    """--set values as model -> {key: value} (the `stages` of bench_spec); a later one wins."""
    out: dict[str, dict[str, str]] = {}
    for model, name, value in settings:
        out.setdefault(model, {})[name] = value
    return out


def overrides(args) -> tuple[dict, dict]:
    engine = {k: v for k, v in (("max_seq_len", args.max_seq_len), ("max_batch_size", args.max_batch_size)) if v}
    return engine, by_model(args.set)


def main(argv=None) -> int:
    args = parse_args(argv)
    engine, stages = overrides(args)
    server = BenchServer(
        args.model,
        args.device,
        args.run_dir,
        engine=engine,
        stages=stages,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        api_port=args.api_port,
    )

    def stop(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell's background job starts with SIGINT ignored, which Python would keep
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        server.start(args.ready_timeout, progress=lambda m: print(m, flush=True))
        print(f"[bench_server] serving; Ctrl-C stops (logs in {args.run_dir})", flush=True)
        while server.alive():
            time.sleep(0.5)
        print(f"[bench_server] a process exited:\n{server.log_tail()}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - report with the logs
        print(f"[bench_server] {exc}\n{server.log_tail()}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
