# What the real design relies on in tritonserver 2.51's Python backend, measured against the
# bundled server with test-only models (tests/triton/fixtures/):
#   echo_stream  decoupled; streams `count` responses, each reporting its execute() call, the
#                number of requests in that call and the request parameters it saw
#   relay        decoupled BLS; forwards its request (and parameters) to echo_stream, relays the stream
#   env_probe    reports the stub's Python environment
#   broken       fails in initialize()
from __future__ import annotations

import json
import os
import queue
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omnistage.core.protocol import CONTRACTS, ModelContract, TensorSpec
from omnistage.launch.render import ModelSpec, default_spec, render_config
from omnistage.launch.tritonserver import TritonStartError

from .conftest import FIXTURES, RepoSpec

ECHO = ModelContract(
    name="echo_stream",
    inputs=(TensorSpec("count", "TYPE_INT64", (1,)),),
    outputs=(TensorSpec("index", "TYPE_INT64", (1,)), TensorSpec("info", "TYPE_STRING", (1,))),
)
PROBE = ModelContract(name="env_probe", inputs=ECHO.inputs, outputs=(ECHO.output("info"),), decoupled=False)


@pytest.fixture(scope="module")
def repo_spec() -> RepoSpec:
    return RepoSpec(
        models={
            "echo_stream": ModelSpec(contract=ECHO),
            # max_batch_size 0 with a dynamic_batching block: accepted, and it changes nothing
            "echo_db0": ModelSpec(contract=ECHO, source="echo_stream", queue_delay_us=0),
            # the configuration that does hand queued requests to one execute()
            "echo_batched": ModelSpec(contract=ECHO, source="echo_stream", max_batch_size=8, queue_delay_us=0),
            "relay": ModelSpec(contract=ECHO),
            "env_probe": ModelSpec(contract=PROBE),
        },
        # the stub ignores it (test_stub_environment); set to show that
        env={**os.environ, "PYTHONPATH": str(FIXTURES / "pylib")},
    )


class Stream:
    """One tritonclient gRPC stream; responses (or errors) arrive on a queue."""

    def __init__(self, client):
        self.client, self.q = client, queue.Queue()
        client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def send(self, model: str, count: int, params: dict | None = None, shape=(1,), request_id: str = "") -> None:
        import tritonclient.grpc as grpcclient

        count_in = grpcclient.InferInput("count", list(shape), "INT64")
        count_in.set_data_from_numpy(np.full(shape, count, dtype=np.int64))
        # enable_empty_final_response: the final flag arrives as its own (empty) response
        self.client.async_stream_infer(
            model, [count_in], request_id=request_id, parameters=params, enable_empty_final_response=True
        )

    def next(self, timeout: float = 10.0):
        """-> ("data", request_id, index, info) | ("final", request_id) | ("error", message)"""
        result, error = self.q.get(timeout=timeout)
        if error is not None:
            return ("error", str(error))
        response = result.get_response()
        if result.as_numpy("index") is not None:
            return ("data", response.id, int(result.as_numpy("index")[0]), json.loads(result.as_numpy("info")[0]))
        assert response.parameters["triton_final_response"].bool_param
        return ("final", response.id)

    def collect(self, n_final: int, timeout: float = 10.0) -> list:
        events, finals = [], 0
        while finals < n_final:
            event = self.next(timeout)
            events.append(event)
            finals += event[0] in ("final", "error")
        return events

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)


def _wait_for_file(path: Path, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} not written within {timeout}s"
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_stream_order_and_final_flag(triton_server):
    s = Stream(triton_server.grpc_client())
    s.send("echo_stream", 3, request_id="r1")
    events = s.collect(1)
    s.close()
    assert [e[:3] for e in events] == [("data", "r1", 0), ("data", "r1", 1), ("data", "r1", 2), ("final", "r1")]


def test_request_parameters_reach_the_model(triton_server):
    # bool, int, float (double_param) and str all arrive typed in request.parameters() (JSON)
    params = {"tag": "p", "count_hint": 7, "flag": True, "ratio": 0.5, "text": "h\u00e9llo"}
    s = Stream(triton_server.grpc_client())
    s.send("echo_stream", 1, params)
    data, final = s.collect(1)
    s.close()
    assert data[3]["parameters"] == params and final[0] == "final"


def test_parameters_pass_through_bls(triton_server):
    # relay builds pb_utils.InferenceRequest(..., parameters=dict) and reads exec(decoupled=True)
    params = {"tag": "bls", "count_hint": 7, "flag": False, "ratio": "0.25", "text": "x"}
    s = Stream(triton_server.grpc_client())
    s.send("relay", 2, {**params, "target": "echo_stream"}, request_id="outer")
    events = s.collect(1)
    s.close()
    assert [e[0] for e in events] == ["data", "data", "final"]
    assert all(e[3]["parameters"] == params for e in events[:2])
    # the callee sees no request id unless the BLS request sets one
    assert events[0][3]["request_id"] == ""


def test_bls_refuses_float_parameters(triton_server):
    # A client's float parameter reaches the model, but pb_utils.InferenceRequest takes only
    # bool/int/str: an orchestrator forwarding sampling parameters must encode floats (e.g. as str).
    s = Stream(triton_server.grpc_client())
    s.send("relay", 1, {"temperature": 0.7})
    events = s.collect(1)
    s.close()
    assert events[0][0] == "error" and "bool/int/str" in events[0][1], events


def test_error_response_ends_the_stream(triton_server):
    s = Stream(triton_server.grpc_client())
    s.send("echo_stream", -1)
    (event,) = s.collect(1)
    s.close()
    assert event[0] == "error" and "count must be >= 0" in event[1]


def test_client_cancel_sets_is_cancelled(triton_server, tmp_path):
    s = Stream(triton_server.grpc_client())
    s.send("echo_stream", 500, {"delay_ms": 20, "tag": "cancel", "report_dir": str(tmp_path)})
    assert [s.next()[0] for _ in range(3)] == ["data"] * 3
    s.close(cancel=True)  # client.stop_stream(cancel_requests=True)
    report = _wait_for_file(tmp_path / "echo_stream-cancel.json")
    assert report["cancelled"] and report["sent"] < 500


def test_cancel_does_not_reach_bls_callee(triton_server, tmp_path):
    # The BLS caller sees its own request cancelled; the request it made with exec(decoupled=True)
    # is not cancelled and the callee streams to the end (2.51 has no cancel for BLS requests), so
    # an orchestrator must stop its callees itself (e.g. talker action=abort).
    s = Stream(triton_server.grpc_client())
    s.send("relay", 40, {"delay_ms": 20, "tag": "bls-cancel", "report_dir": str(tmp_path)})
    assert [s.next()[0] for _ in range(3)] == ["data"] * 3
    s.close(cancel=True)
    relay = _wait_for_file(tmp_path / "relay-bls-cancel.json")
    callee = _wait_for_file(tmp_path / "echo_stream-bls-cancel.json")
    assert relay["cancelled"]
    assert callee == {"sent": 40, "cancelled": False}


def _calls_of_queued_requests(triton_server, model: str, shape) -> dict[str, int]:
    # The first request keeps the only instance busy in execute() for 1 s (its index -1 response
    # says it is in there); four more queue meanwhile.
    s = Stream(triton_server.grpc_client())
    s.send(model, 1, {"hold_ms": 1000}, shape=shape, request_id="hold")
    assert s.next()[:3] == ("data", "hold", -1)
    for i in range(4):
        s.send(model, 1, shape=shape, request_id=f"q{i}")
    events = s.collect(5)
    s.close()
    return {e[1]: (e[3]["call"], e[3]["batch"]) for e in events if e[0] == "data"}


def test_max_batch_size_0_gives_one_request_per_execute(triton_server):
    for model in ("echo_stream", "echo_db0"):
        calls = _calls_of_queued_requests(triton_server, model, shape=(1,))
        queued = [calls[f"q{i}"] for i in range(4)]
        assert len({call for call, _ in queued}) == 4 and all(batch == 1 for _, batch in queued), (model, calls)


def test_dynamic_batching_hands_queued_requests_to_one_execute(triton_server):
    # max_batch_size > 0: every tensor carries a leading batch dim of 1 on the wire
    calls = _calls_of_queued_requests(triton_server, "echo_batched", shape=(1, 1))
    queued = [calls[f"q{i}"] for i in range(4)]
    assert len({call for call, _ in queued}) == 1 and queued[0][1] == 4, calls


def test_custom_metrics_on_metrics_port(triton_server):
    s = Stream(triton_server.grpc_client())
    s.send("echo_stream", 3)
    s.collect(1)
    s.close()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in triton_server.metrics().splitlines()
             if line.startswith("omni_test_")}
    assert lines['omni_test_responses_total{model="echo_stream"}'] >= 3
    assert lines['omni_test_streams_active{model="echo_stream"}'] == 0


def test_stub_environment(triton_server):
    client = triton_server.grpc_client()
    import tritonclient.grpc as grpcclient

    count_in = grpcclient.InferInput("count", [1], "INT64")
    count_in.set_data_from_numpy(np.array([1], dtype=np.int64))
    facts = json.loads(client.infer("env_probe", [count_in]).as_numpy("info")[0])
    # PATH put our interpreter first, so the stub runs in our venv, numpy < 2 included
    assert facts["prefix"] == sys.prefix and facts["numpy"].startswith("1.")
    # the libpython on LD_LIBRARY_PATH matches the venv's interpreter: extension modules load
    assert not facts["imports"]["ssl"].startswith("error")
    assert not facts["imports"]["omnistage"].startswith("error")
    # the stub runs Python isolated: PYTHONPATH is in its environment but not on sys.path
    assert facts["flags"]["isolated"] == 1 and str(FIXTURES / "pylib") in facts["pythonpath"]
    assert facts["imports"]["fixture_probe"].startswith("error: ModuleNotFoundError")


def test_load_failure_is_reported_by_name(triton_launcher):
    started = time.monotonic()
    with pytest.raises(TritonStartError) as failure:
        triton_launcher(RepoSpec(models={"broken": ModelSpec(contract=PROBE)}))
    assert "'broken' failed to load" in str(failure.value) and "broken on purpose" in str(failure.value)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_protocol_configs_parse_as_triton_model_configs(device):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for name, spec in default_spec("dummy:/x/config.json", device).items():
        config = text_format.Parse(render_config(name, spec), model_config_pb2.ModelConfig())
        contract = CONTRACTS[name]
        assert [i.name for i in config.input] == [t.name for t in contract.inputs]
        assert [o.name for o in config.output] == [t.name for t in contract.outputs]
        assert config.model_transaction_policy.decoupled == contract.decoupled
        assert config.parameters["device"].string_value == device
