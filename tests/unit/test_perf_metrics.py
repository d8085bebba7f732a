# perf/: metric aggregation, comparisons and the perf_analyzer profile-export parser (pure logic, CPU).
import json
from pathlib import Path

import numpy as np
import pytest

from perf.compare import comparison
from perf.metrics import LevelResult, RequestRecord, percentile, summarize
from perf.pa_first_response import experiment_summary, request_latencies, summarize_export
from perf.pa_first_response import main as pa_main


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101])
@pytest.mark.parametrize("q", [0, 50, 99, 100])
def test_percentile_matches_numpy(n, q):
    xs = list(np.random.default_rng(n).random(n) * 1000)
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summarize_skips_none_and_scales():
    assert summarize([None, None]) is None
    s = summarize([0.1, None, 0.3], scale=1000)
    assert s["n"] == 2 and s["mean"] == pytest.approx(200) and s["median"] == pytest.approx(200)


def record(i, ttft, ttfp, last, e2e, samples, status="ok"):
    return RequestRecord(index=i, ttft=ttft, ttfp=ttfp, last_audio=last, e2e=e2e, audio_samples=samples, status=status)


def test_rtf_uses_last_audio_chunk_and_decoded_length():
    r = record(0, 0.1, 0.5, 1.2, 1.3, 48000)  # 2 s of audio, last chunk at 1.2 s
    assert r.audio_s == 2.0 and r.rtf == pytest.approx(0.6)
    assert record(0, 0.1, None, None, 1.0, 0).rtf is None


def test_level_summary_counts_and_throughput():
    records = [
        record(0, 0.1, 0.2, 1.0, 1.1, 24000),
        record(1, 0.3, 0.4, 2.0, 2.1, 24000),
        record(2, None, None, None, 0.5, 0, status="error"),
        record(3, 0.2, 0.6, 0.7, None, 0, status="cut"),
        RequestRecord(index=4),
    ]  # never sent: the deadline came first
    records[2].error = "HTTP 400: bad"
    s = LevelResult(concurrency=2, num_prompts=5, wall_s=4.0, records=records).summary()
    assert (s["completed"], s["failed"], s["cut_by_deadline"], s["sent"]) == (2, 1, 2, 4)
    assert s["throughput_rps"] == pytest.approx(0.5)  # completed / wall
    assert s["ttfp_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["n"] == 2
    assert s["rtf"]["mean"] == pytest.approx(1.5)  # (1.0 / 1 s + 2.0 / 1 s) / 2
    assert s["ttfp_ms_incl_cut"]["n"] == 3  # the cut request's first packet counts here
    assert s["errors"] == {"HTTP 400: bad": 1}


def test_comparison_ratios():
    ours = [
        {"concurrency": 64, "completed": 10, "throughput_rps": 10.0, "ttfp_ms": {"mean": 500.0}, "rtf": {"mean": 0.5}},
        {"concurrency": 1, "completed": 0, "throughput_rps": None, "ttfp_ms": None, "rtf": None},
    ]
    base = [{"concurrency": 32, "throughput_rps": 2.0, "ttfp_ms": {"mean": 5000.0}, "rtf": {"mean": 2.0}}]
    (row,) = comparison(ours, base)  # levels that completed nothing are left out
    assert (row["throughput_ratio"], row["ttfp_ratio"], row["rtf_ratio"]) == (5.0, 0.1, 0.25)


# ---- perf_analyzer profile export (format of perf_analyzer's profile_data_exporter.cc) -------------------
MS = 1_000_000  # ns


def synthetic_export():
    t0 = 1_745_526_100_000_000_000
    req = lambda start, outs: {
        "timestamp": t0 + start * MS,
        "request_inputs": {"messages": '[{"role": "user", "content": "hi"}]'},
        "response_timestamps": [t0 + (start + dt) * MS for dt, _ in outs],
        "response_outputs": [o for _, o in outs],
    }
    text = {"text": "Hi", "token_ids": 9707}
    audio = {"audio": [0.1, -0.2, 0.05]}
    final = {}  # the empty final response (triton_enable_empty_final_response)
    c1 = {
        "experiment": {"mode": "concurrency", "value": 1},
        "requests": [
            req(0, [(100, text), (300, audio), (900, audio), (950, final)]),
            req(1000, [(120, text), (140, {"text": "", "token_ids": "", "audio": 0.3}), (200, {"audio": [0.0, 0.1]}),
                       (600, final)]),
        ],
        "window_boundaries": [t0, t0 + 2000 * MS],
    }
    c2 = {
        "experiment": {"mode": "concurrency", "value": 2},
        "requests": [req(0, [(50, text)]), req(0, [])],  # one answered, one never
        "window_boundaries": [],
    }
    return {"version": "2.51.0", "service_kind": "triton", "endpoint": "", "experiments": [c1, c2]}


def test_request_latencies():
    doc = synthetic_export()
    first = request_latencies(doc["experiments"][0]["requests"][0])
    assert first == {"first_response_ms": 100, "ttft_ms": 100, "ttfp_ms": 300, "e2e_ms": 950, "responses": 4}
    second = request_latencies(doc["experiments"][0]["requests"][1])
    # a bare number is how perf_analyzer writes an absent or empty output: audio only counts with samples
    assert second["ttfp_ms"] == 200
    assert request_latencies(doc["experiments"][1]["requests"][1])["first_response_ms"] is None


def test_experiment_summaries_and_cli(tmp_path, capsys):
    doc = synthetic_export()
    c1, c2 = summarize_export(doc)
    assert (c1["mode"], c1["value"], c1["requests"], c1["answered"]) == ("concurrency", 1, 2, 2)
    assert c1["throughput_rps"] == pytest.approx(1.0)  # 2 requests finished inside a 2 s window
    assert c1["ttfp_ms"]["mean"] == pytest.approx(250) and c1["first_response_ms"]["mean"] == pytest.approx(110)
    assert c2["answered"] == 1 and c2["ttfp_ms"] is None
    assert c2["throughput_rps"] == pytest.approx(20.0)  # no windows: 1 answered over its 50 ms span
    path = tmp_path / "export.json"
    path.write_text(json.dumps(doc))
    assert pa_main([str(path), "--out", str(tmp_path / "s.json")]) == 0
    assert "concurrency" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())[0]["value"] == 1


def test_no_outputs_recorded_still_gives_first_response():
    exp = {
        "experiment": {"mode": "request_rate", "value": 2.0},
        "requests": [{"timestamp": 0, "response_timestamps": [5 * MS, 9 * MS]}],
    }
    s = experiment_summary(exp)
    assert s["first_response_ms"]["mean"] == 5 and s["ttfp_ms"] is None and not s["outputs_recorded"]


def test_served_metrics_keeps_labelled_series_by_label(tmp_path):
    import functools
    import http.server
    import threading

    from perf.gpu_bench import served_metrics

    (tmp_path / "metrics").write_text(
        'nv_inference_queue_duration_us{model="thinker",version="1"} 1500\n'
        'nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5\n'
        "omni_talker_steps_total 12\n"
        'omni_milestone_seconds_sum{milestone="preprocessed"} 0.5\n'
        'omni_milestone_seconds_sum{milestone="end"} 9.25\n'
        'omni_milestone_seconds_bucket{milestone="end",le="1"} 0\n'
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = served_metrics(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
    assert got["omni_talker_steps_total"] == [12.0]
    assert got["omni_milestone_seconds_sum"] == [0.5, 9.25]
    assert got['omni_milestone_seconds_sum{milestone="end"}'] == [9.25]
    assert got['nv_inference_queue_duration_us{model="thinker",version="1"}'] == [1500.0]
    assert "nv_gpu_utilization" not in got and not any(k.startswith("omni_milestone_seconds_bucket{") for k in got)


def test_reader_on_a_recorded_export():
    # perf.perf_analyzer.sweep against the tiny checkpoint on the CPU (perf_analyzer 2.51, omni_ensemble, W1,
    # concurrency 2, 4 requests); each audio list trimmed to 4 samples to keep the file small. perf_analyzer
    # wrote the audio of text-only responses as bare numbers (0.0 and garbage such as -4.9e31).
    doc = json.loads((Path(__file__).parent / "fixtures" / "pa_omni_ensemble_w1_c2.json").read_text())
    (experiment,) = doc["experiments"]
    for request in experiment["requests"]:
        outputs = request["response_outputs"]
        first_audio = next(i for i, o in enumerate(outputs) if isinstance(o["audio"], list))
        assert any(isinstance(o["audio"], float) for o in outputs[:first_audio])  # the trap is in the recording
        got = request_latencies(request)
        sent, stamps = request["timestamp"], request["response_timestamps"]
        assert got["ttfp_ms"] == (stamps[first_audio] - sent) / 1e6 and got["ttfp_ms"] > got["ttft_ms"]
    (summary,) = summarize_export(doc)
    assert (summary["value"], summary["requests"], summary["answered"]) == (2, 4, 4)
    assert summary["ttfp_ms"]["n"] == 4 and summary["ttfp_ms"]["mean"] > 2 * summary["ttft_ms"]["mean"]


def test_gpu_bench_refuses_a_budget_that_leaves_the_server_start_too_little():
    from perf.gpu_bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", "/tmp/x", "--budget-s", "155", "--skip-baseline"])
    args = parse_args(["--out", "/tmp/x", "--budget-s", "240", "--skip-baseline"])
    assert args.budget_s == 240
    assert parse_args(["--out", "/tmp/x", "--budget-s", "60", "--skip-server"]).skip_server
