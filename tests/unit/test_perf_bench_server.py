# The benchmark server's spec: engine overrides reach the stages and the ensemble's context checks alike.
import pytest

from perf.bench_server import bench_spec


@pytest.mark.parametrize("device, max_seq_len", [("cpu", 65536), ("cuda", 3584)])
def test_a_context_override_sets_the_ensembles_checks_too(device, max_seq_len):
    spec = bench_spec("checkpoints/tiny", device, {"max_seq_len": max_seq_len})
    ensemble = spec["omni_ensemble"].parameters
    assert spec["thinker"].parameters["max_seq_len"] == str(max_seq_len)
    assert ensemble["max_prompt_tokens"] == spec["thinker"].parameters["max_seq_len"]
    assert ensemble["talker_max_seq_len"] == spec["talker"].parameters["max_seq_len"]


def test_a_stage_setting_of_the_talker_context_reaches_the_ensemble():
    spec = bench_spec("checkpoints/tiny", "cpu", {"max_seq_len": 2048}, {"talker": {"max_seq_len": 4096}})
    assert spec["omni_ensemble"].parameters["max_prompt_tokens"] == "2048"
    assert spec["omni_ensemble"].parameters["talker_max_seq_len"] == "4096"
