# perf/level_split.py: the change of the stages' and Triton's counters over a level, per sequence, request,
# chunk and milestone, from the series names gpu_bench records (perf/gpu_bench.served_metrics).
import gzip
import json

from perf import level_split

BEFORE = {
    "omni_thinker_first_outputs_total": [10.0], "omni_thinker_steps_total": [100.0],
    "omni_thinker_queue_seconds_total": [1.0], "omni_thinker_first_output_seconds_total": [2.0],
    "omni_thinker_prefill_seconds_total": [3.0], "omni_thinker_decode_seconds_total": [4.0],
    'nv_inference_request_success{model="thinker",version="1"}': [10.0],
    'nv_inference_queue_duration_us{model="thinker",version="1"}': [1000.0],
    'omni_handoff_latency_seconds_sum{hop="code2wav",instance="omni_ensemble_0_0"}': [1.0],
    'omni_handoff_latency_seconds_count{hop="code2wav",instance="omni_ensemble_0_0"}': [10.0],
    'omni_milestone_seconds_sum{instance="omni_ensemble_0_0",milestone="preprocessed"}': [0.5],
    'omni_milestone_seconds_count{instance="omni_ensemble_0_0",milestone="preprocessed"}': [5.0],
}  # fmt: skip
AFTER = {
    "omni_thinker_first_outputs_total": [14.0], "omni_thinker_steps_total": [120.0],
    "omni_thinker_queue_seconds_total": [1.4], "omni_thinker_first_output_seconds_total": [3.0],
    "omni_thinker_prefill_seconds_total": [3.5], "omni_thinker_decode_seconds_total": [5.0],
    'nv_inference_request_success{model="thinker",version="1"}': [14.0],
    'nv_inference_queue_duration_us{model="thinker",version="1"}': [9000.0],
    'omni_handoff_latency_seconds_sum{hop="code2wav",instance="omni_ensemble_0_0"}': [1.6],
    'omni_handoff_latency_seconds_count{hop="code2wav",instance="omni_ensemble_0_0"}': [13.0],
    'omni_handoff_latency_seconds_sum{hop="code2wav",instance="omni_ensemble_0_1"}': [0.6],
    'omni_handoff_latency_seconds_count{hop="code2wav",instance="omni_ensemble_0_1"}': [3.0],
    "omni_code2wav_main_chunks_total": [4.0], "omni_code2wav_main_chunk_seconds_total": [0.2],
    "omni_code2wav_first_chunks_total": [2.0], "omni_code2wav_response_delay_seconds_total": [0.06],
    "omni_code2wav_later_chunks_total": [3.0], "omni_code2wav_forwards_total": [5.0],
    'omni_milestone_seconds_sum{instance="omni_ensemble_0_0",milestone="preprocessed"}': [0.8],
    'omni_milestone_seconds_count{instance="omni_ensemble_0_0",milestone="preprocessed"}': [8.0],
    'omni_milestone_seconds_sum{instance="omni_ensemble_0_1",milestone="preprocessed"}': [0.2],
    'omni_milestone_seconds_count{instance="omni_ensemble_0_1",milestone="preprocessed"}': [2.0],
}  # fmt: skip


def test_split_takes_each_series_change_over_the_level():
    got = level_split.split(BEFORE, AFTER)
    assert got["thinker"] == {"sequences": 4.0, "steps": 20.0, "prefill_s": 0.5, "decode_s": 1.0, "queue_ms": 100.0,
                              "first_output_ms": 250.0}  # fmt: skip
    assert "talker" not in got  # no talker series: no row
    assert got["triton"] == {"thinker": {"requests": 4.0, "queue_ms": 2.0, "compute_input_ms": None, "request_ms": None}}
    # 0.6 s over 3 hops on one replica (it had none before) and 0.6 s over 3 on the other
    assert got["code2wav"]["round_trip_ms"] == 200.0
    assert got["code2wav"]["main_in_stage_ms"] == 50.0 and got["code2wav"]["response_wait_ms"] == 10.0
    assert got["code2wav"]["graphed_chunks"] == 3.0 and got["code2wav"]["forwards"] == 5.0  # none before
    assert got["milestones_ms"] == {"preprocessed": 100.0}  # (0.3 + 0.2) s over 3 + 2 requests


def test_levels_reads_a_gzipped_bench_json(tmp_path):
    level = {"concurrency": 64, "throughput_rps": 40.0, "ttfp_ms": {"mean": 300.0}, "rtf": {"mean": 0.4},
             "trace_hops": {"mean_ms": {"frontend -> omni_ensemble arrival": 5.0}},
             "stage_metrics_before": BEFORE, "stage_metrics_after": AFTER}  # fmt: skip
    report = {"ours": {"w1": {"levels": [level, {"concurrency": 1, "skipped": "3s left"}]}},
              "realtime": {"levels": [{"sessions": 32, "latency_ms": {"p50": 400.0}, "turns_with_underruns": 2,
                                       "stage_metrics_before": BEFORE, "stage_metrics_after": AFTER}]}}  # fmt: skip
    path = tmp_path / "bench.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(report, f)
    rows = level_split.levels(level_split.load(path))
    assert [r["level"] for r in rows] == ["w1 c=64", "realtime 32 sessions"]  # the skipped level left out
    assert rows[0]["req_s"] == 40.0 and rows[0]["ttfp_ms"] == 300.0 and rows[0]["thinker"]["queue_ms"] == 100.0
    assert rows[1]["latency_ms"] == {"p50": 400.0} and rows[1]["code2wav"]["round_trip_ms"] == 200.0
