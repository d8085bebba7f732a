# Every place where omnistage works around a behaviour of Triton 2.51 (and its Python backend), what it
# works around and how to tell when it can go. The small ones live here; the larger ones are modules of
# their own, named below. This module imports neither triton_python_backend_utils nor torch: the
# launcher and the frontend's watchdog use it too.
#
# 1. A model reloads only when something changed (forced_reload_config). `load` of a loaded model whose
#    config and files are unchanged since its last load returns at once and does nothing, so a model whose
#    stub died is reloaded once after start and never again (measured on the tiny checkpoint: the second
#    `load` after a SIGKILL returned in 0.0 s, no stub was started, the model stayed "READY" with no
#    process). A config override with a parameter that changes on every reload makes each load start a
#    fresh stub. Can go when two SIGKILL + plain `load_model()` rounds each start a new stub process.
# 2. A dead stub is not reported (stage_watchdog.py, PROBE_ACTION in core/errors.py): is_model_ready stays
#    true and /v2/health/ready stays 200 after a stub died, so the frontend probes every model with a
#    request its execute() answers at once. Can go when is_model_ready turns false after a SIGKILL.
# 3. send() toward a dead caller blocks (SEND_STALL_SECONDS, responder.py): a stage whose caller
#    (omni_ensemble) died can block in response_sender.send() for good, and with it every request of the
#    stage. The responder times its sends and its model answers probes with UNDELIVERABLE_MARK while one
#    has been blocked too long, so the watchdog reloads it. Can go when send() to a dead caller raises.
# 4. A BLS response iterator has no cancel() and no timeout: a stream on a stage that died may never end,
#    holding its omni_ensemble thread. After reloading a stage the watchdog reloads its callers
#    (BLS_CALLERS), whose new stub drops the old threads with the old process; cancelled requests are
#    answered by the responder even while their thread is stuck (CANCEL_GRACE_SECONDS), so that Triton can
#    release them and unload the old instance. Can go when ResponseIterator has cancel().
# 5. The stub frees finished BLS iterators on a native thread without the GIL, which corrupts the heap:
#    iterator_reaper.py. Can go when pb_stub.cc's SendCleanupId keeps the last reference.
# 6. BLS threads deadlock at Triton's default pool of 32 (python_backend_args): every open BLS call holds
#    a thread of the backend's pool; a few dozen concurrent omni_ensemble requests take all of them. Can go
#    with BLS calls that hold no server thread while they wait.
# 7. The stub's shared-memory region grows under load, and a stub died silently when full-size GPU handoffs
#    outgrew it (python_backend_args, GPU servers only). Can go when growth failures are reported.
# 8. A model being reloaded is named only in error text (NOT_READY): requests to it fail with "Request for
#    unknown model: ... is not ready" (or "... has no available versions", or "Server not ready" while the
#    server shuts down for a restart) and no status code of its own;
#    both omni_ensemble (bls.py) and the frontend (triton_codec.py) read the text to answer 503, retryable.
#    Can go when Triton reports UNAVAILABLE for these on gRPC and in BLS.
# 9. An instance replaced while requests were in flight on its dead or stopped stub never finishes
#    unloading (stale_stubs): Triton waits for those requests, which nothing ends, so the instance keeps
#    ~515 backend threads, its shm region and, for a stopped stub, its memory (on the GPU its CUDA memory
#    too). Its stub cannot simply be killed: a stub killed while Triton finalizes its instance aborts
#    tritonserver. Such an instance shows as a live stub with a newer one for its instance, or as a dead stub
#    never reaped (a zombie: the server reaps a stub only when its instance unloads), and counts once it
#    outlives STALE_STUB_GRACE_SECONDS with every model READY. The launcher's TritonServer restarts the
#    server once restart_after_stale such instances exist, or one has for stale_restart_s. Can go when a reload of a model whose stub died ends its in-flight requests and unloads
#    the old instance.
# 10. Concurrent metric calls from several threads of a stub crash the server: one publisher thread per
#    instance writes every metric (metrics.py). Can go when the stub's metric API is thread-safe.
# 11. BLS has no cancellation: a cancelled omni_ensemble request sends action=abort to each stage it started
#    (pipeline/request.py). Can go when cancelling a BLS request reaches the callee's is_cancelled().
# 12. A callee is not told that its BLS caller died: the requests of a dead omni_ensemble stub never turn
#    is_cancelled() in the stages. A talker stream waits for its text rows, and a Code2Wav session for its next
#    chunk, with nothing in flight that could fail. Both end once their caller has been silent for
#    CALLER_SILENT_SECONDS (the talker's responder: Responder.expect_caller; Code2Wav: session_idle_s), far
#    above the longest gap between a live caller's appends or chunks. Can go with (11).
# 13. A stub fault can take tritonserver down as a whole. Measured under load on the tiny checkpoint: a
#    code2wav stub stopped (SIGSTOP) until Triton had answered its requests "Stub process ... is not healthy",
#    then continued (SIGCONT), died in its decode with a segmentation fault, and tritonserver aborted
#    (boost::interprocess::lock_exception in TRITONBACKEND_ModelInstanceExecute). The launcher's TritonServer
#    starts a server that exits by itself again, on the same ports with the same key (restart_on_exit). Can
#    go when a stub that stops and resumes neither crashes nor takes the server with it.
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

PYTHON_THREAD_POOL = 512  # BLS threads (6); omni_ensemble's max_inflight default is sized from it
SHM_REGION_BYTES, SHM_GROWTH_BYTES = 512 << 20, 128 << 20  # per stub, GPU servers only (7)

# the config parameter that changes on every forced reload (1)
LOAD_GENERATION = "load_generation"
# the model that calls the others through BLS (4); its name in omnistage.core.protocol.OMNI
BLS_CALLERS = ("omni_ensemble",)
# a send() blocked this long means the caller is gone (3): far above one response's IPC round trip
# (milliseconds) and the longest a live caller's stub pauses (a GIL-bound preprocessing step, seconds)
SEND_STALL_SECONDS = 15.0
UNDELIVERABLE_MARK = "cannot deliver"
# a request whose client left and whose thread has not ended it after this long is answered by the
# responder (4)
CANCEL_GRACE_SECONDS = 5.0
STALE_STUB_GRACE_SECONDS = 30.0  # a normal unload finalizes the old stub within seconds
# a stage stream whose caller sent nothing for this long is ended (12): a live caller appends a talker's text
# rows and sends Code2Wav's chunks at the thinker's and talker's step rate, well under a second apart
CALLER_SILENT_SECONDS = 60.0
NOT_READY = re.compile(r"unknown model|is not ready|not at ready state|has no available versions|is not found|"
                       r"Server not ready")


def python_backend_args(gpus: Sequence[int]) -> list[str]:
    """tritonserver's Python-backend options that keep BLS from deadlocking (6) and stubs alive (7)."""
    args = [f"--backend-config=python,thread-pool-size={PYTHON_THREAD_POOL}"]
    if gpus:
        # a region this large never grows in practice (tmpfs pages are only used as touched)
        args += [f"--backend-config=python,shm-default-byte-size={SHM_REGION_BYTES}",
                 f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}"]  # fmt: skip
    return args


def forced_reload_config(config: dict) -> str:
    """The model's config (as get_model_config returns it) with LOAD_GENERATION one higher, as JSON for
    load_model(config=...): a load that always starts a fresh stub (1)."""
    config = json.loads(json.dumps(config))
    parameters = config.setdefault("parameters", {})
    generation = int(parameters.get(LOAD_GENERATION, {}).get("string_value", "0")) + 1
    parameters[LOAD_GENERATION] = {"string_value": str(generation)}
    return json.dumps(config)


def stale_stubs(server_pid: int, dead_since: dict[int, float] | None = None,
                grace_s: float = STALE_STUB_GRACE_SECONDS) -> list[int]:
    """Pids of the server's Python stubs whose instance a reload replaced more than grace_s ago and that have not
    unloaded (9): live stubs whose model instance (argv[8], e.g. talker_0_0) has a newer stub, and dead stubs
    not reaped (zombies, whose argv is gone) with a stub started after they were seen dead. dead_since: the
    caller's record of dead stubs, pid -> seconds since boot when first seen, updated here."""
    from omnistage.launch.proc_stats import children, cmdline, process_state

    tick = os.sysconf("SC_CLK_TCK")
    now = float(Path("/proc/uptime").read_text().split()[0])  # the clock of the start times: since boot
    by_instance: dict[str, list[tuple[float, int]]] = {}
    dead, live = {}, []
    for pid in children(server_pid):
        argv = cmdline(pid)
        try:
            started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / tick
        except (OSError, IndexError, ValueError):
            continue
        if process_state(pid)["state"] == "Z":
            dead[pid] = (dead_since or {}).get(pid, now)
        elif len(argv) > 8 and argv[0].endswith("triton_python_backend_stub"):
            by_instance.setdefault(argv[8], []).append((started, pid))
            live.append(started)
    if dead_since is not None:
        dead_since.clear()
        dead_since.update(dead)
    stale = []
    for stubs in by_instance.values():
        newest = max(stubs)
        if now - newest[0] > grace_s:
            stale += [pid for started, pid in stubs if (started, pid) != newest]
    stale += [pid for pid, seen in dead.items() if any(seen <= started < now - grace_s for started in live)]
    return stale
