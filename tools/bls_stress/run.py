# A minimal stand-in for omni_ensemble's BLS traffic without any model, for the crash of Triton 2.51's
# Python stub, which frees finished BLS response iterators off the GIL (omnistage/triton/iterator_reaper.py,
# perf/results/h200-graphs-bls-crash.json): rounds of CONCURRENCY streaming requests to `driver`; stops at the
# first hang or error and prints any fatal stub stacks. --reaper holds finished iterators as omni_ensemble
# does, which should never fault; --bf16-bytes sends host tensors the way our stages answer BLS.
#
#   python tools/bls_stress/run.py [--concurrency 32] [--rounds 10] [--device cpu|cuda|mixed] [--state 1200000]
#                                  [--reaper] [--bf16-bytes] [--free-probe] [--keep-views]
#                                  [--triton-arg=--pinned-memory-pool-byte-size=0]
#
# `--free-probe` (without --bf16-bytes) faults within a round on this CPU machine unless --reaper is given:
# proof that the stub frees the numpy arrays of BLS responses in a native thread, off the GIL.
from __future__ import annotations

import argparse
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from omnistage.launch.tritonserver import TritonServer  # noqa: E402

HERE = Path(__file__).resolve().parent


def one_stream(url: str, counts: dict, lock: threading.Lock, wait_s: float) -> None:
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    n = grpcclient.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([1], np.int32))
    client.async_stream_infer("driver", [n], enable_empty_final_response=True)
    outcome = "hung"
    try:
        while True:
            result, error = answers.get(timeout=wait_s)  # a dead stub never answers
            if error is not None:
                outcome = f"error: {error}"
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                outcome = "ok"
                break
    except queue.Empty:
        pass
    client.stop_stream(cancel_requests=outcome != "ok")  # a hung stream would block its close forever
    with lock:
        counts[outcome] = counts.get(outcome, 0) + 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda", "mixed"),
        help="where the tensors live; mixed: each echo_big response has a host and a GPU tensor",
    )
    ap.add_argument("--state", type=int, default=1_200_000)
    ap.add_argument("--run-dir", default="/tmp/bls_stress")
    ap.add_argument("--bf16-bytes", action="store_true", help="host tensors as BF16 views of their bytes")
    ap.add_argument("--wait-s", type=float, default=20, help="a stream with no answer for this long is hung")
    ap.add_argument("--free-probe", action="store_true", help="fault if a response array is freed off the GIL")
    ap.add_argument("--reaper", action="store_true", help="hold finished iterators as omni_ensemble does")
    ap.add_argument("--early", action="store_true", help="leave each BLS call at its first response")
    ap.add_argument("--keep-views", action="store_true", help="keep received tensors as views, not copies")
    # e.g. --triton-arg=--pinned-memory-pool-byte-size=0: the H200 machine has a 256 MB pinned pool for
    # host tensors, this CPU machine none, and the fault shows only there
    ap.add_argument("--triton-arg", action="append", default=[], help="extra tritonserver argument (repeat)")
    args = ap.parse_args()
    run = Path(args.run_dir)
    shutil.rmtree(run, ignore_errors=True)
    repo = run / "repo"
    for model in ("echo_big", "driver"):
        shutil.copytree(HERE / model, repo / model)
    if args.device in ("cuda", "mixed"):  # the stage on the GPU, as ours are
        cfg = repo / "echo_big" / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace("kind: KIND_CPU", "kind: KIND_GPU gpus: [0]"))
    env = dict(os.environ, BLS_STRESS_DEVICE=args.device, BLS_STRESS_STATE=str(args.state),
               BLS_STRESS_EARLY="1" if args.early else "0", BLS_STRESS_BF16_BYTES="1" if args.bf16_bytes else "0",
               BLS_STRESS_FREE_PROBE="1" if args.free_probe else "0",
               BLS_STRESS_REAPER="1" if args.reaper else "0", BLS_STRESS_VIEWS="1" if args.keep_views else "0")  # fmt: skip
    gpus = [0] if args.device in ("cuda", "mixed") else []
    server = TritonServer.on_free_ports(repo, run, gpus=gpus, env=env, extra_args=args.triton_arg)
    server.start_and_wait(timeout=180)
    counts: dict = {}
    lock = threading.Lock()
    try:
        for i in range(args.rounds):
            t0 = time.time()
            threads = [threading.Thread(target=one_stream, args=(server.grpc_url, counts, lock, args.wait_s))
                       for _ in range(args.concurrency)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print(f"round {i}: {counts} in {time.time() - t0:.1f}s", flush=True)
            if set(counts) != {"ok"}:
                break
    finally:
        log = server.log_tail(400)
        server.stop()
    fatal = [line for line in log.splitlines() if "Fatal" in line or "File " in line or "Segmentation" in line]
    print("\n".join(fatal[:60]) or "no fatal stub errors in the log")
    probe = [line for line in log.splitlines() if line.startswith("free probe:")]
    if probe:  # all freed on our threads (or the stub would have died), and not simply kept for ever
        print(probe[-1])
    return 0 if set(counts) == {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
