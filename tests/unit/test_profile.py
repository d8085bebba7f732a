# Deploy profiles: merging (base, platform block, overlays), validation errors that name the key, and the
# model repository rendered from a profile (replica models, instance groups, GPUs, parameters).
import json
import textwrap

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from omnistage.core.protocol import CONTRACTS
from omnistage.launch import render
from omnistage.launch.profile import BASE_PROFILE, ProfileError, load_profile, replica_names
from omnistage.launch.triton_env import REPO_ROOT

REFERENCE = REPO_ROOT / "deploy" / "overlays" / "reference_3gpu.yaml"
SINGLE_GPU = REPO_ROOT / "deploy" / "overlays" / "single_gpu.yaml"
MODEL = "dummy:/x/config.json"


def overlay(tmp_path, text: str, name="overlay.yaml"):
    path = tmp_path / name
    path.write_text(f"base: {BASE_PROFILE}\n" + textwrap.dedent(text))
    return path


def parsed(name, spec):
    return text_format.Parse(render.render_config(name, spec), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_base_profile_is_the_default_layout(platform):
    spec = render.default_spec(MODEL, platform)
    assert list(spec) == ["thinker", "talker", "code2wav", "omni_ensemble"]
    cuda = platform == "cuda"
    for name in ("thinker", "talker"):
        p = spec[name].parameters
        assert p["max_batch_size"] == ("64" if cuda else "8") and p["max_seq_len"] == ("65536" if cuda else "1024")
        assert p["dtype"] == ("bfloat16" if cuda else "float32")
    assert spec["code2wav"].parameters["max_batch_windows"] == "64"
    omni = spec["omni_ensemble"].parameters
    # first audio after 1 frame on cuda (CPU tests count the 4-frame first chunk); no light-load schedule
    first = "1" if cuda else "4"
    # the first lane also takes realtime replies' first chunks (the playback schedule's: 6 frames)
    assert spec["code2wav"].parameters.get("first_chunk_frames") == ("1,6" if cuda else "4,6")
    assert (omni["first_chunk_frames"], omni["chunk_frames"], omni["max_inflight"]) == (first, "25", "128")
    assert (omni.get("light_first_chunk_frames"), omni.get("light_load_requests")) == (None, None)
    assert (omni["thinker_models"], omni["talker_models"]) == ("thinker", "talker")
    for name, s in spec.items():
        assert (s.kind, s.gpus) == (("KIND_GPU", (0,)) if cuda and name != "omni_ensemble" else ("KIND_CPU", ()))


def test_reference_layout_renders_replica_models_on_their_gpus():
    profile = load_profile(REFERENCE, gpu_count=3)
    assert profile.platform == "cuda"
    spec = render.profile_spec(profile, MODEL)
    assert sorted(spec) == ["code2wav", "code2wav_1", "omni_ensemble", "talker", "talker_1", "thinker"]
    configs = {name: parsed(name, s) for name, s in spec.items()}
    placement = {n: [(g.count, g.kind, list(g.gpus)) for g in c.instance_group] for n, c in configs.items()}
    gpu = model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert placement["thinker"] == [(1, gpu, [0])]
    assert placement["talker"] == [(1, gpu, [1])] and placement["talker_1"] == [(1, gpu, [2])]
    assert placement["code2wav"] == [(1, gpu, [1])] and placement["code2wav_1"] == [(1, gpu, [2])]
    for name, config in configs.items():  # a replica carries its stage's contract under its own name
        contract = CONTRACTS[name.split("_1")[0]]
        assert config.name == name and [i.name for i in config.input] == [t.name for t in contract.inputs]
    assert configs["omni_ensemble"].parameters["talker_models"].string_value == "talker,talker_1"
    assert configs["omni_ensemble"].parameters["code2wav_models"].string_value == "code2wav,code2wav_1"


def test_cpu_platform_keeps_replicas_and_drops_gpus(tmp_path):
    path = overlay(tmp_path, "stages: {thinker: {replicas: 2}, talker: {replicas: 3}, code2wav: {replicas: 2}}\n")
    spec = render.profile_spec(load_profile(path, "cpu"), MODEL)
    assert sorted(spec) == ["code2wav", "code2wav_1", "omni_ensemble", "talker", "talker_1", "talker_2", "thinker",
                            "thinker_1"]  # fmt: skip
    assert all(s.kind == "KIND_CPU" and s.instances == 1 for s in spec.values())
    assert spec["code2wav_1"].source == "code2wav"
    assert spec["talker_2"].source == "talker"
    assert spec["omni_ensemble"].parameters["thinker_models"] == "thinker,thinker_1"


def test_overlay_wins_over_the_base_platform_block(tmp_path):
    path = overlay(tmp_path, """\
        stages: {thinker: {max_batch_size: 32, memory_fraction: 0.5,
                           sampling: {temperature: 0.7, stop_token_ids: [1, 2]}},
                 talker: {kv_cache_bytes: 1000000}, omni_ensemble: {max_media_items: 4}}
        chunks: {first_chunk_frames: 2}
        platforms: {cpu: {stages: {talker: {max_queue: 7}}}}
    """)
    cuda = render.profile_spec(load_profile(path, "cuda"), MODEL)
    thinker = cuda["thinker"].parameters
    assert thinker["max_batch_size"] == "32" and thinker["max_seq_len"] == "65536"  # overlay, then cuda block
    assert thinker["memory_fraction"] == "0.5"
    assert thinker["kv_cache_bytes"] == str(24 << 30)  # the cuda block's pool
    assert json.loads(thinker["sampling_defaults"]) == {"temperature": 0.7, "stop_token_ids": [1, 2]}
    assert cuda["talker"].parameters["max_queue"] == "1024"
    assert cuda["talker"].parameters["kv_cache_bytes"] == "1000000"
    assert cuda["omni_ensemble"].parameters["first_chunk_frames"] == "2"
    assert cuda["code2wav"].parameters["first_chunk_frames"] == "2,6"
    assert cuda["omni_ensemble"].parameters["max_media_items"] == "4"
    assert render.profile_spec(load_profile(path, "cpu"), MODEL)["talker"].parameters["max_queue"] == "7"


@pytest.mark.parametrize(
    "text, error",
    [
        ("stages: {vocoder: {replicas: 1}}", "unknown stage(s) vocoder"),
        ("stages: {talker: {replica: 2}}", "stages.talker: unknown key(s) replica"),
        ("stages: {talker: {devices: [0, 3]}}", "stages.talker.devices: GPU 3 is out of range, 2 GPU(s) visible (0-1)"),
        ("stages: {talker: {devices: [0, 1], replicas: 3}}", "3 replicas cannot be spread evenly over GPUs [0, 1]"),
        ("stages: {code2wav: {devices: [1, 1]}}", "lists a GPU twice"),
        ("stages: {thinker: {replicas: 0}}", "stages.thinker.replicas must be an integer >= 1, got 0"),
        ("stages: {thinker: {cuda_graphs: true}}", "stages.thinker: unknown key(s) cuda_graphs"),
        ("stages: {talker: {max_prefill_tokens: 16384}}", "stages.talker: unknown key(s) max_prefill_tokens"),
        ("stages: {talker: {max_queue: 0}}", "stages.talker.max_queue must be an integer >= 1, got 0"),
        ("stages: {thinker: {max_seq_len: null}}", "stages.thinker.max_seq_len is required"),
        ("stages: {thinker: {devices: 0}}", "stages.thinker.devices must be a list of GPU indices"),
        ("stages: {talker: {prefix_cache_bytes: 1}}", "stages.talker: unknown key(s) prefix_cache_bytes"),
        ("stages: {omni_ensemble: {max_audio_seconds: -1}}", "stages.omni_ensemble.max_audio_seconds must be a positive"),
        ("stages: {omni_ensemble: {max_media_items: 2.5}}", "stages.omni_ensemble.max_media_items must be a positive int"),
        ("stages: {omni_ensemble: {max_inflight: 0}}", "stages.omni_ensemble.max_inflight must be an integer >= 1"),
        ("stages: {talker: {sampling: {temprature: 0.5}}}", "stages.talker.sampling: got an unexpected keyword argument 'temprature'"),
        ("stages: {talker: {sampling: {top_p: 0}}}", "stages.talker.sampling: top_p must be in (0, 1]"),
        ("chunks: {chunk_frames: 0}", "chunks.chunk_frames must be an integer >= 1, got 0"),
        ("chunks: {chunk_frames: 70000}", "chunks.chunk_frames (70000) is longer than any talker stream can be"),
        ("chunks: {left_context_frames: 3}", "chunks: unknown key(s) left_context_frames"),
        ("chunks: {light_first_chunk_frames: 0}", "chunks.light_first_chunk_frames must be an integer >= 1, got 0"),
        ("chunks: {light_load_requests: 0}", "chunks.light_load_requests must be an integer >= 1, got 0"),
        ("stages: {thinker: {memory_fraction: 0.8}, talker: {memory_fraction: 0.3}}",
         "GPU 0: memory_fraction of its stage instances adds up to 1.1 (thinker 0.8, talker 0.3)"),
        ("stages: {talker: {memory_fraction: 1.5}}", "stages.talker.memory_fraction must be in (0, 1]"),
        ("stages: {thinker: {kv_cache_bytes: 0}}", "stages.thinker.kv_cache_bytes must be an integer >= 1"),
        ("stages: {code2wav: {kv_cache_bytes: 1000}}", "stages.code2wav: unknown key(s) kv_cache_bytes"),
        ("platforms: {tpu: {}}", "unknown platform(s) tpu"),
        ("dtype: int8", "dtype must be one of"),
        ("handoff: cpu", "unknown key(s) handoff"),
        ("stage: {}", "unknown key(s) stage"),
    ],
)
def test_mistakes_are_reported_by_key(tmp_path, text, error):
    with pytest.raises(ProfileError) as e:
        load_profile(overlay(tmp_path, text + "\n"), "cuda", gpu_count=2)
    assert error in str(e.value)


def test_gpu_range_is_checked_against_the_visible_count_and_only_on_cuda():
    with pytest.raises(ProfileError, match="GPU 2 is out of range, 2 GPU"):
        load_profile(REFERENCE, gpu_count=2)
    load_profile(REFERENCE, gpu_count=None)  # unknown count (no GPU here): placement is checked where it runs
    assert load_profile(REFERENCE, "cpu", gpu_count=0).stages["talker"].replicas == 2


def test_single_gpu_overlay_fits_one_gpu():
    profile = load_profile(SINGLE_GPU, gpu_count=1)
    spec = render.profile_spec(profile, MODEL)
    assert {s.gpus for n, s in spec.items() if n != "omni_ensemble"} == {(0,)}
    assert spec["thinker"].parameters["memory_fraction"] == "0.7"


def test_overlay_cycle_and_missing_files(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ProfileError, match="cycle"):
        load_profile(tmp_path / "a.yaml")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.yaml")


def test_replica_names():
    assert replica_names("talker", 1) == ["talker"]
    assert replica_names("talker", 3) == ["talker", "talker_1", "talker_2"]


def test_render_cli_writes_the_profile_and_rejects_a_bad_one(tmp_path, capsys):
    out = tmp_path / "repo"
    render.main(["--profile", str(REFERENCE), "--device", "cpu", "--model", MODEL, "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["code2wav", "code2wav_1", "omni_ensemble", "talker", "talker_1",
                                                     "thinker"]  # fmt: skip
    assert (out / "talker_1" / "1" / "model.py").read_text() == (REPO_ROOT / "model_repository/talker/1/model.py").read_text()
    with pytest.raises(SystemExit, match="GPU 2 is out of range"):
        render.main(["--profile", str(REFERENCE), "--gpus", "2", "--model", MODEL, "--out", str(out)])
