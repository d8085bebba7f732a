# Deploy profiles: YAML that says where each stage runs and how it is sized (deploy/qwen3_omni_moe.yaml
# explains the keys). Loading merges, in order: the base file, its `platforms:<platform>` block, then each
# overlay (a file naming its parent as `base:`) with its own platform block. Validation turns every
# mistake into one ProfileError that names the key. Triton-agnostic: render.py maps a Profile to configs.
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from omnistage.core.errors import OmniError
from omnistage.core.sampling import SamplingParams
from omnistage.launch.triton_env import REPO_ROOT

BASE_PROFILE = REPO_ROOT / "deploy" / "qwen3_omni_moe.yaml"
PLATFORMS = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
ENGINE_STAGES = ("thinker", "talker")  # KV-cache engines; sessions are pinned to one replica
STAGES = (*ENGINE_STAGES, "code2wav", "omni_ensemble")
_PLACED = {"devices", "replicas", "memory_fraction"}
_KEYS = {
    "thinker": _PLACED | {"max_batch_size", "max_seq_len", "max_queue", "max_prefills_per_step", "max_prefill_tokens",
                          "sampling", "kv_cache_bytes", "kv_cache_memory_fraction"},  # fmt: skip
    "code2wav": _PLACED | {"max_batch_size"},
    "omni_ensemble": {"replicas", "max_inflight", "max_queue", "max_audio_seconds", "max_image_pixels", "max_media_items"},
}
_KEYS["talker"] = set(_KEYS["thinker"])
_KEYS["thinker"] |= {"prefix_cache_bytes"}
_TOP_KEYS = {"base", "description", "platform", "dtype", "model", "stages", "chunks", "platforms"}
_CHUNK_KEYS = {"first_chunk_frames", "chunk_frames", "left_context_frames", "light_first_chunk_frames",
               "light_load_requests"}


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class StageProfile:
    name: str
    replicas: int = 1
    devices: tuple[int, ...] = (0,)
    settings: dict = field(default_factory=dict)  # the stage's other keys, validated

    def replica_names(self) -> list[str]:
        return replica_names(self.name, self.replicas)

    def replica_devices(self) -> list[int]:
        """GPU of each replica: spread evenly, in order (replicas is a multiple of len(devices))."""
        per_device = self.replicas // len(self.devices)
        return [d for d in self.devices for _ in range(per_device)]


@dataclass(frozen=True)
class Profile:
    platform: str
    dtype: str
    stages: dict[str, StageProfile]
    chunks: dict[str, int | None]
    model: str | None = None
    sources: tuple[Path, ...] = ()  # files merged, base first


def replica_names(stage: str, replicas: int) -> list[str]:
    """Model names of a stage's replicas: the first keeps the stage's name (so one replica = today's layout)."""
    return [stage] + [f"{stage}_{i}" for i in range(1, replicas)]


def visible_gpu_count() -> int | None:
    """GPUs this process would see (CUDA_VISIBLE_DEVICES, else nvidia-smi); None when it cannot tell."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


def load_profile(path: Path | str = BASE_PROFILE, platform: str | None = None, gpu_count: int | None = None) -> Profile:
    """Reads, merges and validates a profile; platform None = the profile's `platform:` (default cpu)."""
    chain = _chain(Path(path))
    raw = {}
    for doc in chain:  # the platform is known only once every file was read: an overlay may set it
        raw = _merge(raw, {k: v for k, v in doc.items() if k != "platforms"})
    platform = platform or raw.get("platform") or "cpu"
    if platform not in PLATFORMS:
        raise ProfileError(f"platform must be one of {', '.join(PLATFORMS)}, not {platform!r}")
    merged: dict = {}
    for doc in chain:
        delta = (doc.get("platforms") or {}).get(platform) or {}
        merged = _merge(_merge(merged, {k: v for k, v in doc.items() if k != "platforms"}), delta)
    return _validate(merged, platform, gpu_count, tuple(d["__file__"] for d in chain))


def _chain(path: Path, seen: tuple[Path, ...] = ()) -> list[dict]:
    path = path.resolve()
    if path in seen:
        raise ProfileError(f"{path}: overlays form a cycle")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ProfileError(f"profile {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: a profile is a mapping, got {type(doc).__name__}")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise ProfileError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(_TOP_KEYS))}")
    platforms = doc.get("platforms") or {}
    bad = set(platforms) - set(PLATFORMS)
    if bad:
        raise ProfileError(f"{path}: unknown platform(s) {', '.join(sorted(bad))}; valid: {', '.join(PLATFORMS)}")
    parents = _chain(path.parent / doc.pop("base"), seen + (path,)) if "base" in doc else []
    return parents + [dict(doc, __file__=path)]


def _merge(base: dict, delta: dict) -> dict:
    out = dict(base)
    for key, value in delta.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _validate(raw: dict, platform: str, gpu_count: int | None, sources: tuple[Path, ...]) -> Profile:
    raw.pop("__file__", None)
    dtype = raw.get("dtype") or ("bfloat16" if platform == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ProfileError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    stages_raw = raw.get("stages") or {}
    unknown = set(stages_raw) - set(STAGES)
    if unknown:
        raise ProfileError(f"unknown stage(s) {', '.join(sorted(unknown))}; the stages are {', '.join(STAGES)}")
    stages = {name: _stage(name, stages_raw.get(name) or {}, platform, gpu_count) for name in STAGES}
    chunks = _chunks(raw.get("chunks") or {}, stages["talker"].settings["max_seq_len"])
    if platform == "cuda":
        _check_memory(stages)
    model = raw.get("model")
    return Profile(platform, dtype, stages, chunks, str(model) if model is not None else None, sources)


def _int(where: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProfileError(f"{where} must be an integer >= {low}, got {value!r}")
    return value


def _stage(name: str, raw: dict, platform: str, gpu_count: int | None) -> StageProfile:
    if not isinstance(raw, dict):
        raise ProfileError(f"stages.{name} must be a mapping, got {raw!r}")
    unknown = set(raw) - _KEYS[name]
    if unknown:
        raise ProfileError(f"stages.{name}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(_KEYS[name]))}")
    where = f"stages.{name}"
    replicas = _int(f"{where}.replicas", raw.get("replicas", 1))
    settings = {k: v for k, v in raw.items() if k not in ("replicas", "devices")}
    devices: tuple[int, ...] = (0,)
    if "devices" in _KEYS[name] and platform == "cuda":  # on the CPU, devices say nothing
        devices = tuple(_int(f"{where}.devices[]", d, low=0) for d in (raw.get("devices") or [0]))
        if len(set(devices)) != len(devices):
            raise ProfileError(f"{where}.devices lists a GPU twice: {list(devices)}")
        if gpu_count is not None and max(devices) >= gpu_count:
            raise ProfileError(f"{where}.devices: GPU {max(devices)} is out of range, {gpu_count} GPU(s) visible"
                               + (f" (0-{gpu_count - 1})" if gpu_count else ""))  # fmt: skip
        if replicas % len(devices):
            raise ProfileError(f"{where}: {replicas} replicas cannot be spread evenly over GPUs {list(devices)}")
    for key in ("max_batch_size", "max_seq_len", "max_queue", "max_prefills_per_step", "max_prefill_tokens",
                "max_inflight"):  # fmt: skip
        if key in settings:
            _int(f"{where}.{key}", settings[key])
    if name in ENGINE_STAGES:
        for key in ("max_batch_size", "max_seq_len"):
            if key not in settings:
                raise ProfileError(f"{where}.{key} is required")
        if settings.get("max_prefills_per_step", 1) > settings["max_batch_size"]:
            raise ProfileError(f"{where}.max_prefills_per_step exceeds max_batch_size ({settings['max_batch_size']})")
        settings["sampling"] = _sampling(where, settings.get("sampling") or {}, settings["max_seq_len"])
    for key in ("memory_fraction", "kv_cache_memory_fraction"):
        fraction = settings.get(key)
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):  # fmt: skip
            raise ProfileError(f"{where}.{key} must be in (0, 1], got {fraction!r}")
    if settings.get("prefix_cache_bytes") is not None:
        _int(f"{where}.prefix_cache_bytes", settings["prefix_cache_bytes"], low=0)
    if settings.get("kv_cache_bytes") is not None:
        _int(f"{where}.kv_cache_bytes", settings["kv_cache_bytes"])
        if settings.get("kv_cache_memory_fraction") is not None:
            raise ProfileError(f"{where}: give kv_cache_bytes or kv_cache_memory_fraction, not both")
    return StageProfile(name, replicas, devices, settings)


def _sampling(where: str, raw: dict, max_seq_len: int) -> dict:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}.sampling must be a mapping, got {raw!r}")
    values = {"max_tokens": max(1, max_seq_len // 2), **raw}  # the stages' own default is at most this
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    try:
        SamplingParams(**values).validate(max_seq_len)
    except TypeError as e:
        raise ProfileError(f"{where}.sampling: {e}".replace("SamplingParams.__init__() ", "")) from None
    except OmniError as e:
        raise ProfileError(f"{where}.sampling: {e}") from None
    return dict(raw)


def _chunks(raw: dict, talker_seq_len: int) -> dict[str, int | None]:
    unknown = set(raw) - _CHUNK_KEYS
    if unknown:
        raise ProfileError(f"chunks: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(_CHUNK_KEYS))}")
    chunks = {"first_chunk_frames": 4, "chunk_frames": 25, "left_context_frames": None,
              "light_first_chunk_frames": None, "light_load_requests": 1, **raw}  # fmt: skip
    _int("chunks.light_load_requests", chunks["light_load_requests"])
    sized = ["first_chunk_frames", "chunk_frames"]
    if chunks["light_first_chunk_frames"] is not None:  # null: no light-load schedule
        sized.append("light_first_chunk_frames")
    for key in sized:
        _int(f"chunks.{key}", chunks[key])
        # a chunk is cut once that many frames exist; a talker slot never holds more than max_seq_len
        if chunks[key] > talker_seq_len:
            raise ProfileError(f"chunks.{key} ({chunks[key]}) is longer than any talker stream can be "
                               f"(stages.talker.max_seq_len {talker_seq_len}): no audio before the end")  # fmt: skip
    if chunks["left_context_frames"] is not None:
        # a later chunk re-emits the previous chunk's held-back tail from this context, so 0 cannot work;
        # less than the checkpoint's conv reach is refused by code2wav when it loads (not exact)
        _int("chunks.left_context_frames", chunks["left_context_frames"])
    return chunks


def _check_memory(stages: dict[str, StageProfile]) -> None:
    per_gpu: dict[int, list[tuple[str, float]]] = {}
    for stage in stages.values():
        fraction = stage.settings.get("memory_fraction")
        if fraction is not None and "devices" in _KEYS[stage.name]:
            for gpu in stage.replica_devices():
                per_gpu.setdefault(gpu, []).append((stage.name, float(fraction)))
    for gpu, parts in sorted(per_gpu.items()):
        total = sum(f for _, f in parts)
        if total > 1.0 + 1e-9:
            listed = ", ".join(f"{n} {f:g}" for n, f in parts)
            raise ProfileError(f"GPU {gpu}: memory_fraction of its stage instances adds up to {total:g} ({listed}); "
                               "it must be <= 1")  # fmt: skip
