# The OpenAI frontend's own time under load, without a model: the real frontend process over a fake Triton at
# the gRPC level (tests/api/fake_triton.py: an `omni_ensemble` that answers every request with a scripted
# W1-shaped reply, 18 text deltas and 3.7 s of audio, its first token after 50 ms), driven by loadgen.py.
# Per workload: the frontend's time from a request's arrival to its hand-over to Triton (body read and
# parsed, media checked: the frontend's request traces) and to its first token, the client's TTFT, and the
# frontend's CPU seconds. The media workloads' bodies (W3's 5 s clip is ~210 kB) against W1's (~1 kB).
#
#   python -m perf.frontend_timing OUT.json [--workloads w1,w3,w4] [--concurrency 64] [--repeat 1]
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np

from tests.api.fake_triton import FakeTriton, Reply, infer_response
from tests.api.servers import FrontendProcess


def w1_shaped_reply() -> list[Reply]:
    replies = [Reply(infer_response(text="Hello", token_ids=[9707]), delay_s=0.05),
               Reply(infer_response(audio=np.zeros(1920, np.float32)), delay_s=0.02)]  # fmt: skip
    replies += [Reply(infer_response(text=" word", token_ids=[1]), delay_s=0.02) for _ in range(17)]
    replies += [Reply(infer_response(audio=np.zeros(28800, np.float32)), delay_s=0.3) for _ in range(3)]
    usage = {"prompt_tokens": 150, "completion_tokens": 18, "audio_frames": 46}
    return replies + [Reply(infer_response(finish_reason="length", usage=usage, final=True))]


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def level(fe: FrontendProcess, trace_dir: str, seen: int, workload: str, concurrency: int) -> tuple[dict, int]:
    out = tempfile.mktemp(suffix=".json")
    cpu, start = cpu_seconds(fe.proc.pid), time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "perf.loadgen", "--url", fe.url, "--workload", workload, "--concurrency", str(concurrency),
        "--prompts-per-level-factor", "3", "--reply-tokens", "18", "--frames", "46", "--out", out,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(err.decode()[-2000:])
    cpu, wall = cpu_seconds(fe.proc.pid) - cpu, time.perf_counter() - start
    await asyncio.sleep(1)  # the frontend writes a request's trace when it closes
    rows = [json.loads(line) for f in sorted(glob.glob(f"{trace_dir}/*")) for line in open(f)]
    rows, seen = rows[seen:], len(rows)
    handled = [1e3 * (r["handled"] - r["arrival"]) for r in rows if r.get("handled")]
    first = [1e3 * (r["first_token"] - r["arrival"]) for r in rows if r.get("first_token")]
    client = json.load(open(out))["levels"][0]
    os.unlink(out)
    return {"requests": len(handled), "arrival_to_handled_ms": {"mean": round(float(np.mean(handled)), 1),
            "p90": round(float(np.percentile(handled, 90)), 1)}, "arrival_to_first_token_ms": round(float(np.mean(first)), 1),
            "client_ttft_ms": round(client["ttft_ms"]["mean"], 1), "frontend_cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2)}, seen  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--workloads", default="w1,w3,w4")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the workloads")
    a = ap.parse_args()
    trace_dir = tempfile.mkdtemp(prefix="frontend-trace-")
    report, seen = {"concurrency": a.concurrency, "cpus": os.cpu_count(), "rounds": []}, 0
    async with FakeTriton(replies=w1_shaped_reply()) as fake:
        with FrontendProcess("--triton-url", fake.url, env={"OMNI_TRACE_DIR": trace_dir}) as fe:
            for _ in range(a.repeat):
                round_ = {}
                for workload in a.workloads.split(","):
                    round_[workload], seen = await level(fe, trace_dir, seen, workload, a.concurrency)
                    print(workload, round_[workload], flush=True)
                report["rounds"].append(round_)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
