# One GPU device call: the transformers baseline, then our server on the same (dummy full-size) weights,
# the W1 sweep, media-in levels, realtime sessions and a short W2 subset, all under one time budget. Every phase has a deadline derived from
# what is left, so the run ends in time whatever happens, and bench.json is rewritten after each phase
# (a kill still leaves the phases done so far). Run through perf/gpu_bench.sh.
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from omnistage.core.request_trace import TRACE_DIR_ENV
from omnistage.launch.proc_stats import dump_stub_stacks, process_state, server_cpu_seconds, stub_pids
from perf import loadgen, realtime_load, trace_join, workloads
from perf.bench_server import BenchServer, by_model, stage_setting
from perf.compare import comparison, plot_bench, reference, summary_text
from perf.gpu_sampler import GpuSampler

REPO = Path(__file__).resolve().parents[1]
FULL_CONFIG = REPO / "perf" / "qwen3_omni_30b_a3b_instruct.config.json"
# a realtime level: turns per session and the longest wait for one turn's reply
REALTIME_TURNS = 3
REALTIME_TURN_TIMEOUT_S = 30.0


class Budget:
    def __init__(self, total_s: float, reserve_s: float):
        self.t0, self.total_s, self.reserve_s = time.monotonic(), total_s, reserve_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        """Seconds left for work (the final reserve excluded)."""
        return self.total_s - self.reserve_s - self.elapsed()

    def slice(self, cap: float, keep_for_later: float = 0.0) -> float:
        return max(0.0, min(cap, self.left() - keep_for_later))


def say(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hardware() -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        q = "name,memory.total,driver_version"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout.strip()
        info["gpus"] = [dict(zip(q.split(","), (v.strip() for v in line.split(",")))) for line in out.splitlines()]
    except (OSError, subprocess.SubprocessError) as exc:
        info["gpus"] = f"nvidia-smi failed: {exc}"
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("torch", "transformers", "tritonclient", "nvidia-pytriton", "aiohttp"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    return info


def gpu_processes() -> list[dict] | str:
    """GPU memory held by each process on the GPU (nvidia-smi), with its command line: where memory goes,
    beside the stages' own torch peaks and KV pool sizes (served_metrics)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {exc}"
    procs = []
    for line in out.splitlines():
        pid, _, mib = (v.strip() for v in line.partition(","))
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            cmd = ""
        procs.append({"pid": pid, "used_mib": mib, "cmd": cmd.strip()})
    return procs


def pack_stacks(stacks: Path, out: Path) -> None:
    """The stubs' stack dumps in `stacks` (OMNI_STACKS_DIR) as out/stacks.tar.gz: the device returns few files."""
    if stacks.is_dir():
        time.sleep(1.0)  # faulthandler writes from the stubs' signal handlers
        subprocess.run(["tar", "czf", str(out / "stacks.tar.gz"), "-C", str(stacks.parent), stacks.name], check=False)


def served_metrics(url: str) -> dict:
    """The stages' own gauges / counters (omni_<stage>_<what>) and Triton's per-model request counters
    (nv_inference_*: a request's wait in Triton's queue for its model's execute(), among others) from the
    metrics endpoint: name -> the values of its series; a labelled series (histogram buckets aside) also as
    'name{labels}' -> [value]."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    out: dict[str, list[float]] = {}
    for name, labels, value in re.findall(r"^(omni_\w+|nv_inference_\w+)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        out.setdefault(name, []).append(float(value))
        if labels and not name.endswith("_bucket"):
            out.setdefault(name + labels, []).append(float(value))
    return out


class Bench:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.budget = Budget(args.budget_s, args.reserve_s)
        self.tmp = Path(tempfile.mkdtemp(prefix="omnistage_gpu_bench_"))
        self.report: dict = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "what": "omnistage (Triton, staged) vs transformers generate() on the same weights, one GPU",
            "weights": (
                "dummy: seeded random weights (omnistage.models.checkpoint, seed 0), speed only"
                if args.model.startswith("dummy:")
                else f"checkpoint {args.model}"
            ),
            "model": {
                "source": args.model,
                "device": args.device,
                "config": "Qwen3-Omni-30B-A3B-Instruct, full size (35.26 B params)"
                if args.model == f"dummy:{FULL_CONFIG}"
                else "see source",
            },
            "hardware": hardware(),
            "reference": reference(),
            "phases": [],
            "ours": {},
            "baseline": None,
        }
        self.server: BenchServer | None = None
        self.stubs: dict[str, list[int]] = {}  # model -> its stubs' pids, as the server started
        self.stacks_dir = self.tmp / "stacks"  # where stubs write their stacks: OMNI_STACKS_DIR (start_server)

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def save(self) -> None:
        self.report["elapsed_s"] = self.budget.elapsed()
        if self.report["baseline"] and self.report["ours"].get("w1"):
            self.report["comparison"] = comparison(self.report["ours"]["w1"]["levels"], self.report["baseline"]["runs"])
        path = self.out / "bench.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1))
        tmp.replace(path)

    def phase(self, name: str, status: str, t0: float, **extra) -> None:
        entry = {"name": name, "status": status, "seconds": round(time.monotonic() - t0, 1), **extra}
        self.report["phases"].append(entry)
        say(f"phase {name}: {status} in {entry['seconds']}s" + (f" ({extra['note']})" if extra.get("note") else ""))
        self.save()

    # ---- phases ---------------------------------------------------------------------------------------
    def baseline(self) -> None:
        a = self.args
        limit = self.budget.slice(a.baseline_cap_s, keep_for_later=a.server_min_s + a.bench_min_s)
        t0 = time.monotonic()
        if limit < 60:
            return self.phase("baseline", "skipped", t0, note=f"only {limit:.0f}s left for it")
        out = self.tmp / "baseline.json"
        cmd = [sys.executable, "-m", "perf.baseline_transformers", "--model", a.model, "--device", a.device,
               "--batch", *map(str, a.baseline_batch), "--requests", str(a.baseline_requests),
               "--reply-tokens", str(a.w1_reply_tokens), "--frames", str(a.w1_frames),
               "--time-budget", str(max(10.0, limit - 45)), "--out", str(out)]  # fmt: skip
        say(f"baseline: {' '.join(cmd[2:])} (limit {limit:.0f}s)")
        try:
            rc = subprocess.run(cmd, cwd=REPO, timeout=limit, check=False).returncode
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = "timed out (partial)"  # run() killed it; what it saved per batch size is kept
        if out.is_file():
            self.report["baseline"] = json.loads(out.read_text())
        self.phase("baseline", status, t0, note=None if out.is_file() else "no results written")

    def start_server(self) -> bool:
        a = self.args
        limit = self.budget.slice(a.server_cap_s, keep_for_later=a.bench_min_s)
        t0 = time.monotonic()
        engine = {"max_seq_len": a.max_seq_len}
        self.report["server"] = {"device": a.device, "engine_overrides": engine, "instances": a.instances,
                                 "stage_settings": a.stage_settings, "ready_timeout_s": limit}  # fmt: skip
        b = a.port_base
        # each stub writes its stacks there on SIGUSR1 (omnistage/triton/logs.py): sent after any level with
        # requests cut by its deadline, i.e. stalled, and packed into stacks.tar.gz at the end
        os.environ.setdefault("OMNI_STACKS_DIR", str(self.tmp / "stacks"))
        self.stacks_dir = Path(os.environ["OMNI_STACKS_DIR"])
        # the frontend and omni_ensemble write a line per request there: each level's hops between processes
        os.environ.setdefault(TRACE_DIR_ENV, str(self.tmp / "trace"))
        self.trace_dir = Path(os.environ[TRACE_DIR_ENV])
        try:
            self.server = BenchServer(
                a.model,
                a.device,
                self.tmp / "server",
                engine=engine,
                stages=a.stage_settings,
                instances=a.instances,
                http_port=b,
                grpc_port=b + 1,
                metrics_port=b + 2,
                api_port=b + 91,
            )
            self.report["server"]["spec"] = {n: s.parameters for n, s in self.server.spec.items()}
            ready = self.server.start(limit, progress=say)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on to write what it has
            self.phase("server_start", "failed", t0, note=str(exc)[-2000:])
            return False
        self.report["server"]["triton_ready_s"] = ready
        # the stubs as started: a stall's evidence names each one's state, also once it is gone from the tree
        self.stubs = stub_pids(self.server.triton.process.pid)
        self.phase("server_start", "ok", t0)
        return True

    def sweep(
        self,
        name: str,
        workload: workloads.Workload,
        levels: list[int],
        sizes: list[int],
        weights: list[float],
        share: float,
        warmup: int,
    ) -> None:
        """The levels of one workload within `share` of the time left, split by weight as levels finish."""
        t0 = time.monotonic()
        pot = max(0.0, self.budget.left() * share)
        deadline = time.monotonic() + pot
        result = loadgen.results_json(self.server.api_url, workload, self.report["date"], levels, sizes, warmup)
        self.report["ours"][name] = result
        try:
            if warmup:
                limit = min(self.args.warmup_cap_s, pot * 0.25)
                level = asyncio.run(
                    loadgen.run_level(
                        self.server.api_url, workload, warmup, warmup, timeout_s=limit, label=f"{name} warm-up"
                    )
                )
                s = level.summary()
                result["warmup"] = {
                    k: s[k] for k in ("num_prompts", "completed", "failed", "cut_by_deadline", "wall_s", "errors")
                }
            offset = warmup
            for i, (c, n) in enumerate(zip(levels, sizes)):
                left = deadline - time.monotonic()
                limit = left * weights[i] / sum(weights[i:])
                if limit < 5 or not self.server.alive():
                    result["levels"].append(
                        {
                            "concurrency": c,
                            "num_prompts": n,
                            "skipped": "server down" if not self.server.alive() else f"{left:.0f}s left",
                        }
                    )
                    continue
                say(f"{name} c={c}: {n} prompts, {limit:.0f}s limit")
                cpu_before, gpu = self.cpu_seconds(), GpuSampler().start()
                metrics_before = self.stage_metrics()  # the level's own share: after - before (warm-ups excluded)
                level = asyncio.run(
                    loadgen.run_level(self.server.api_url, workload, c, n, offset=offset, timeout_s=limit)
                )
                offset += n
                entry = level.summary()
                entry["gpu_utilization"] = gpu.stop()
                # per part of the stack over the level: near one core's worth (wall_s) = bound by that part's GIL
                entry["cpu_seconds"] = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in self.cpu_seconds().items()}
                entry["requests"] = [r.to_json() for r in level.records]
                # mean ms per hop of the first token's and first audio's way: client, frontend, omni_ensemble
                entry["trace_hops"] = trace_join.hop_means(entry["requests"], trace_join.load_traces(self.trace_dir))
                # the frontend's own histograms (omni_frontend_*: arrival at the frontend -> first token / audio
                # received from Triton) split the time between omni_ensemble and the client
                entry["stage_metrics_before"] = metrics_before
                entry["stage_metrics_after"] = self.stage_metrics()
                # stalled requests (cut by the deadline, or failed: the frontend ends a hung server's requests
                # with a 503): what every stub's threads are doing now
                if entry.get("cut_by_deadline") or entry.get("failed"):
                    entry["stub_stacks_dumped"] = self.dump_stub_stacks()
                    entry["stub_states"] = self.stall_evidence()
                result["levels"].append(entry)
                say(f"{name} c={c}: {loadgen._line(entry)}")
                self.save()
            self.phase(name, "ok", t0)
        except Exception as exc:  # noqa: BLE001
            self.phase(name, "failed", t0, note=f"{type(exc).__name__}: {exc}"[:1000])

    def stage_metrics(self) -> dict:
        """Triton's metrics (the stages' omni_* counters) and the frontend's, as they are now."""
        frontend = self.server.api_url.rstrip("/") + "/metrics"
        return {**served_metrics(self.server.triton.metrics_url), **served_metrics(frontend)}

    def dump_stub_stacks(self) -> int:
        process = self.server.triton.process if self.server else None
        return dump_stub_stacks(process.pid) if process and process.pid else 0

    def stall_evidence(self) -> dict[str, list[dict]]:
        """Each stub's and the server's process state (a stub that is gone or in D state writes no stacks; the
        server's thread count shows its BLS pool), and beside the stacks the GPU's view (nvidia-smi) and the
        kernel log's end (driver Xid errors), once per run."""
        stacks = self.stacks_dir
        stacks.mkdir(parents=True, exist_ok=True)
        for name, cmd in (("nvidia-smi.txt", ["nvidia-smi"]), ("dmesg.txt", ["dmesg"])):
            if not (stacks / name).exists():
                try:  # a hung GPU can hang nvidia-smi too
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=False)
                    (stacks / name).write_text((run.stdout + run.stderr)[-20000:])
                except (OSError, subprocess.TimeoutExpired) as exc:
                    (stacks / name).write_text(f"{cmd[0]}: {exc}\n")
        processes = dict(self.stubs)
        if self.server is not None and self.server.triton.process is not None:  # its threads: the BLS pool
            processes["tritonserver"] = [self.server.triton.process.pid]
        return {name: [dict(process_state(pid), pid=str(pid)) for pid in pids] for name, pids in processes.items()}

    def pack_stacks(self) -> None:
        """stacks.tar.gz in OUT when a level dumped the stubs' stacks (the device returns few files)."""
        levels = [lv for wl in self.report.get("ours", {}).values() for lv in wl.get("levels", [])]
        if any(lv.get("stub_stacks_dumped") for lv in levels):
            pack_stacks(self.stacks_dir, self.out)

    def cpu_seconds(self) -> dict[str, float]:
        triton, frontend = self.server.triton.process, self.server.frontend
        return server_cpu_seconds(triton.pid, frontend.pid) if triton and triton.pid else {}

    def finish(self) -> None:
        self.pack_stacks()
        if self.server is not None:
            (self.out / "server_log_tail.txt").write_text(self.server.log_tail(200))
            t0 = time.monotonic()
            self.server.stop()
            self.phase("server_stop", "ok", t0)
        self.report["plot"] = plot_bench(self.report, self.out / "bench.png")
        self.save()
        print(summary_text(self.report), flush=True)

    def realtime(self, sessions: list[int], share: float) -> None:
        """realtime_load's levels (REALTIME_TURNS turns a session) on the same server, after two turns of one
        session, within `share` of the time left; a level that runs out of time is recorded as cut."""
        t0 = time.monotonic()
        deadline = t0 + max(0.0, self.budget.left() * share)
        utterance = realtime_load.load_utterance(None)
        url = realtime_load.ws_url(self.server.api_url, None)
        result = self.report["realtime"] = {"utterance_s": len(utterance) / 2 / realtime_load.RATE,
                                                   "turns_per_session": REALTIME_TURNS, "levels": []}  # fmt: skip

        def level(n: int, turns: int) -> dict:
            run = realtime_load.run_level(url, n, turns, utterance, REALTIME_TURN_TIMEOUT_S)
            return asyncio.run(asyncio.wait_for(run, timeout=max(1.0, deadline - time.monotonic())))

        try:
            result["warmup"] = level(1, 2)
            for n in sessions:
                if deadline - time.monotonic() < 20 or not self.server.alive():
                    result["levels"].append({"sessions": n, "skipped": "server down" if not self.server.alive()
                                             else f"{deadline - time.monotonic():.0f}s left"})  # fmt: skip
                    continue
                say(f"realtime: {n} sessions x {REALTIME_TURNS} turns")
                metrics_before = self.stage_metrics()
                entry = level(n, REALTIME_TURNS)
                entry["stage_metrics_before"], entry["stage_metrics_after"] = metrics_before, self.stage_metrics()
                result["levels"].append(entry)
                lat = entry["latency_ms"]
                say(f"realtime {n}: p50 {lat['p50'] or 0:.0f} ms, p99 {lat['p99'] or 0:.0f} ms, failed turns "
                    f"{entry['failed_turns']}, turns with underruns {entry['turns_with_underruns']}")
                self.save()
            self.phase("realtime", "ok", t0)
        except Exception as exc:  # noqa: BLE001 - a cut level (TimeoutError) among them
            self.phase("realtime", "failed", t0, note=f"{type(exc).__name__}: {exc}"[:1000])

    def run(self) -> None:
        a = self.args
        self.save()
        if not a.skip_baseline:
            self.baseline()
        if a.skip_server or not self.start_server():
            return
        w1 = workloads.w1(256).with_lengths(a.w1_reply_tokens, a.w1_frames)
        w1_sizes = loadgen.level_sizes(a.w1_concurrency, a.w1_factor, a.w1_min_prompts)
        w2_share = 0.0 if a.skip_w2 else a.w2_share
        media_share = a.media_share if a.media else 0.0
        realtime_share = a.realtime_share if a.realtime else 0.0
        self.sweep(
            "w1",
            w1,
            a.w1_concurrency,
            w1_sizes,
            [2.0 + c / 16 for c in a.w1_concurrency],
            1.0 - w2_share - media_share - realtime_share,
            warmup=a.warmup,
        )
        for i, (name, levels) in enumerate(a.media):  # W3, W4, W5: media in, each with its own warm-up
            sizes = loadgen.level_sizes(levels, a.w1_factor, a.w1_min_prompts)
            t0 = time.monotonic()
            try:
                workload = workloads.build(name, max(sizes)).with_lengths(a.w1_reply_tokens, a.w1_frames)
            except ImportError as missing:  # W5's clips are made with PyAV, which a bare GPU image lacks
                self.phase(name, "skipped", t0, note=str(missing))
                continue
            # its even part of the media's share, against the media's, realtime's and W2's shares still to run
            part = media_share / len(a.media)
            share = part / (part * (len(a.media) - i) + realtime_share + w2_share)
            self.sweep(name, workload, levels, sizes, [2.0 + c / 16 for c in levels], share, warmup=a.warmup)
        if a.realtime:
            self.realtime(a.realtime, realtime_share / (realtime_share + w2_share))
        if not a.skip_w2:
            w2 = workloads.w2(8, prompt_tokens=a.w2_prompt_tokens).with_lengths(a.w2_reply_tokens, a.w2_reply_tokens)
            self.sweep(
                "w2",
                w2,
                a.w2_concurrency,
                [a.w2_prompts_per_level * c for c in a.w2_concurrency],
                [1.0] * len(a.w2_concurrency),
                1.0,
                warmup=0,
            )


def _instances(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        model, _, count = item.partition("=")
        if not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: expected MODEL=N with N >= 1")
        out[model] = int(count)
    return out


def _media_levels(text: str) -> tuple[str, list[int]]:
    name, _, levels = text.partition(":")
    if name not in ("w3", "w4", "w5") or not levels or not all(c.isdigit() and int(c) > 0 for c in levels.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected w3:C[,C...], w4:C[,C...] or w5:C[,C...]")
    return name, [int(c) for c in levels.split(",")]


def add_model_args(ap: argparse.ArgumentParser, device_help: str) -> None:
    ap.add_argument("--model", default=None, help="default: the full-size dummy weights on cuda, the tiny "
                    "checkpoint on cpu")  # fmt: skip
    ap.add_argument("--device", default="cuda", help=device_help)


def parse_model_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parses, then fills --model: the full-size config's dummy weights on a GPU; on the CPU (a dry run) the
    full size would not fit in memory, so the tiny checkpoint."""
    args = ap.parse_args(argv)
    args.model = args.model or (f"dummy:{FULL_CONFIG}" if args.device == "cuda" else "checkpoints/tiny")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m perf.gpu_bench")
    ap.add_argument("--out", required=True, help="dir for bench.json, bench.png, server_log_tail.txt")
    add_model_args(ap, "cpu: a dry run of the whole script")
    ap.add_argument("--port-base", type=int, default=18200, help="http, grpc, metrics = base..base+2; API base+91")
    ap.add_argument("--budget-s", type=float, default=float(env("PERF_BUDGET_S", 510)), help="whole run")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="kept for server stop, plot and files")
    ap.add_argument("--baseline-cap-s", type=float, default=160.0)
    ap.add_argument("--baseline-batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--baseline-requests", type=int, default=3)
    ap.add_argument("--server-cap-s", type=float, default=240.0, help="most seconds for the server to load")
    ap.add_argument("--server-min-s", type=float, default=90.0, help="kept for the server when the baseline runs")
    ap.add_argument("--bench-min-s", type=float, default=90.0, help="kept for the load phases")
    # W2 needs prompt 2500 + 900 reply <= max_seq_len (talker: ~2505 rows + 900 frames + 1); KV at 64 slots:
    # thinker 96 KiB x 3584 x 64 = 21 GiB, talker 20 KiB x 3584 x 64 = 4.4 GiB
    ap.add_argument("--max-seq-len", type=int, default=int(env("PERF_MAX_SEQ_LEN", 3584)))
    ap.add_argument("--w1-concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument(
        "--w1-factor", type=float, default=float(env("PERF_W1_FACTOR", 2)), help="prompts = factor x concurrency"
    )
    ap.add_argument("--w1-min-prompts", type=int, default=2)
    ap.add_argument("--w1-reply-tokens", type=int, default=18)
    ap.add_argument("--w1-frames", type=int, default=46)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--warmup-cap-s", type=float, default=40.0)
    ap.add_argument("--media", type=_media_levels, nargs="*", default=[], metavar="W:C[,C]",
                    help="media-in levels after W1 (W1's lengths and prompt factor), e.g. w3:1,64 w4:64 w5:16")  # fmt: skip
    ap.add_argument("--media-share", type=float, default=0.4, help="of the time left after the server start")
    ap.add_argument("--realtime", type=int, nargs="*", default=[], metavar="SESSIONS",
                    help="realtime_load levels after the media levels, e.g. 32 64")  # fmt: skip
    ap.add_argument("--realtime-share", type=float, default=0.3, help="of the time left after the server start")
    ap.add_argument("--w2-concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--w2-prompts-per-level", type=int, default=1, help="x concurrency")
    ap.add_argument("--w2-share", type=float, default=0.3, help="of the time left after the server start")
    ap.add_argument("--w2-prompt-tokens", type=int, default=2500)
    ap.add_argument("--w2-reply-tokens", type=int, default=900, help="= codec frames")
    ap.add_argument("--instances", type=_instances, default={}, metavar="MODEL=N[,MODEL=N]",
                    help="instance_group count per model, e.g. omni_ensemble=2 (stage replicas: the profile)")  # fmt: skip
    ap.add_argument("--set", dest="stage_settings", type=stage_setting, action="append", default=[],
                    metavar="MODEL.KEY=VALUE", help="a model's config parameter, e.g. thinker.max_batch_size=32")  # fmt: skip
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-w2", action="store_true", default=env("PERF_SKIP_W2") == "1")
    args = parse_model_args(ap, argv)
    args.stage_settings = by_model(args.stage_settings)
    # the server's start gets what the budget leaves after the load phases and the reserve: a budget that
    # leaves it less than --server-min-s would cut a full-size start mid-capture and measure nothing
    start = args.budget_s - args.reserve_s - args.bench_min_s
    if not args.skip_server and start < args.server_min_s:
        ap.error(f"--budget-s {args.budget_s:g} leaves the server's start {start:g} s (after --bench-min-s "
                 f"{args.bench_min_s:g} and --reserve-s {args.reserve_s:g}), under --server-min-s {args.server_min_s:g}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    bench = Bench(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    try:
        bench.run()
    except KeyboardInterrupt as stop:
        bench.report["phases"].append({"name": "interrupted", "status": str(stop)})
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bench.finish()
        say(f"done in {bench.budget.elapsed():.0f}s: {Path(args.out) / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
