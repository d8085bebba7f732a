# Deploy profiles: YAML that says where each stage runs and how it is sized (deploy/qwen3_omni_moe.yaml
# documents every key). Loading merges, in order: the base file, its `platforms:<platform>` block, then each
# overlay (a file naming its parent as `base:`) with its own platform block. The merged mapping becomes the
# dataclasses below, each checking its own fields in __post_init__, so every mistake is one ProfileError that
# names the key. Triton-agnostic: render.py maps a Profile to model configs.
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from omnistage.core.errors import OmniError
from omnistage.core.sampling import SamplingParams
from omnistage.launch.triton_env import REPO_ROOT
from omnistage.models.media import MediaLimits

BASE_PROFILE = REPO_ROOT / "deploy" / "qwen3_omni_moe.yaml"
PLATFORMS = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
ENGINE_STAGES = ("thinker", "talker")  # KV-cache engines; sessions are pinned to one replica
STAGES = (*ENGINE_STAGES, "code2wav", "omni_ensemble")
_TOP_KEYS = {"base", "description", "platform", "dtype", "model", "stages", "chunks", "platforms"}


class ProfileError(ValueError):
    pass


def _int(where: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProfileError(f"{where} must be an integer >= {low}, got {value!r}")
    return value


def _fraction(where: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ProfileError(f"{where} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class StageProfile:
    """Placement and capacity of one stage. Engine stages (thinker, talker) need max_batch_size and
    max_seq_len; prefix_cache_bytes is the thinker's; omni_ensemble is placed on the CPU (no devices) and
    takes the request limits (max_inflight, media)."""

    name: str
    replicas: int = 1
    devices: tuple[int, ...] = (0,)
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_queue: int | None = None
    memory_fraction: float | None = None
    kv_cache_bytes: int | None = None
    prefix_cache_bytes: int | None = None
    sampling: dict = field(default_factory=dict)
    max_inflight: int | None = None
    media: dict = field(default_factory=dict)  # MediaLimits fields set by the profile

    def __post_init__(self):
        where = f"stages.{self.name}"
        _int(f"{where}.replicas", self.replicas)
        for d in self.devices:
            _int(f"{where}.devices[]", d, low=0)
        if len(set(self.devices)) != len(self.devices):
            raise ProfileError(f"{where}.devices lists a GPU twice: {list(self.devices)}")
        if self.replicas % len(self.devices):
            raise ProfileError(f"{where}: {self.replicas} replicas cannot be spread evenly over GPUs {list(self.devices)}")
        for key in ("max_batch_size", "max_seq_len", "max_queue", "kv_cache_bytes", "max_inflight"):
            if getattr(self, key) is not None:
                _int(f"{where}.{key}", getattr(self, key))
        if self.prefix_cache_bytes is not None:
            _int(f"{where}.prefix_cache_bytes", self.prefix_cache_bytes, low=0)
        _fraction(f"{where}.memory_fraction", self.memory_fraction)
        if self.name in ENGINE_STAGES:
            for key in ("max_batch_size", "max_seq_len"):
                if getattr(self, key) is None:
                    raise ProfileError(f"{where}.{key} is required")
            _check_sampling(where, self.sampling, self.max_seq_len)
        defaults = MediaLimits()
        for key, value in self.media.items():
            want = type(getattr(defaults, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or want(value) != value:
                raise ProfileError(f"{where}.{key} must be a positive {want.__name__}, got {value!r}")

    def replica_names(self) -> list[str]:
        return replica_names(self.name, self.replicas)

    def replica_devices(self) -> list[int]:
        """GPU of each replica: spread evenly, in order (replicas is a multiple of len(devices))."""
        per_device = self.replicas // len(self.devices)
        return [d for d in self.devices for _ in range(per_device)]


# the keys each stage takes (the others are refused by name)
_PLACED = {"devices", "replicas", "memory_fraction"}
_ENGINE = _PLACED | {"max_batch_size", "max_seq_len", "max_queue", "kv_cache_bytes", "sampling"}
_MEDIA = {f.name for f in fields(MediaLimits)} - {"max_prompt_tokens"}  # that one is the thinker's max_seq_len
_KEYS = {
    "thinker": _ENGINE | {"prefix_cache_bytes"},
    "talker": _ENGINE,
    "code2wav": _PLACED | {"max_batch_size"},
    "omni_ensemble": {"replicas", "max_inflight", "max_queue"} | _MEDIA,
}


@dataclass(frozen=True)
class ChunkProfile:
    """How a talker stream is cut into Code2Wav chunks, in codec frames (12.5 per second)."""

    first_chunk_frames: int = 4
    chunk_frames: int = 25
    light_first_chunk_frames: int | None = None  # while at most light_load_requests requests are in flight
    light_load_requests: int = 1

    def check(self, talker_seq_len: int) -> None:
        _int("chunks.light_load_requests", self.light_load_requests)
        sized = ["first_chunk_frames", "chunk_frames"]
        if self.light_first_chunk_frames is not None:  # null: no light-load schedule
            sized.append("light_first_chunk_frames")
        for key in sized:
            value = _int(f"chunks.{key}", getattr(self, key))
            # a chunk is cut once that many frames exist; a talker slot never holds more than max_seq_len
            if value > talker_seq_len:
                raise ProfileError(f"chunks.{key} ({value}) is longer than any talker stream can be "
                                   f"(stages.talker.max_seq_len {talker_seq_len}): no audio before the end")  # fmt: skip


@dataclass(frozen=True)
class Profile:
    platform: str
    dtype: str
    stages: dict[str, StageProfile]
    chunks: ChunkProfile
    model: str | None = None
    sources: tuple[Path, ...] = ()  # files merged, base first

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ProfileError(f"platform must be one of {', '.join(PLATFORMS)}, not {self.platform!r}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        self.chunks.check(self.stages["talker"].max_seq_len)
        if self.platform == "cuda":
            _check_memory(self.stages)


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
    return _build(merged, platform, gpu_count, tuple(d["__file__"] for d in chain))


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


def _build(raw: dict, platform: str, gpu_count: int | None, sources: tuple[Path, ...]) -> Profile:
    stages_raw = raw.get("stages") or {}
    unknown = set(stages_raw) - set(STAGES)
    if unknown:
        raise ProfileError(f"unknown stage(s) {', '.join(sorted(unknown))}; the stages are {', '.join(STAGES)}")
    stages = {name: _stage(name, stages_raw.get(name) or {}, platform, gpu_count) for name in STAGES}
    chunks_raw = raw.get("chunks") or {}
    if not isinstance(chunks_raw, dict):
        raise ProfileError(f"chunks must be a mapping, got {chunks_raw!r}")
    valid = {f.name for f in fields(ChunkProfile)}
    if set(chunks_raw) - valid:
        raise ProfileError(f"chunks: unknown key(s) {', '.join(sorted(set(chunks_raw) - valid))}; "
                           f"valid: {', '.join(sorted(valid))}")  # fmt: skip
    model = raw.get("model")
    dtype = raw.get("dtype") or ("bfloat16" if platform == "cuda" else "float32")
    return Profile(platform, dtype, stages, ChunkProfile(**chunks_raw), str(model) if model is not None else None,
                   sources)  # fmt: skip


def _stage(name: str, raw: dict, platform: str, gpu_count: int | None) -> StageProfile:
    where = f"stages.{name}"
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be a mapping, got {raw!r}")
    unknown = set(raw) - _KEYS[name]
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(_KEYS[name]))}")
    values = {k: v for k, v in raw.items() if v is not None and k not in _MEDIA}
    values["media"] = {k: v for k, v in raw.items() if v is not None and k in _MEDIA}
    values["devices"] = (0,)
    if "devices" in raw and platform == "cuda":  # on the CPU, devices say nothing
        devices = [0] if raw["devices"] is None else raw["devices"]
        if not isinstance(devices, list) or not devices:
            raise ProfileError(f"{where}.devices must be a list of GPU indices, got {devices!r}")
        values["devices"] = tuple(devices)
        for d in devices:
            _int(f"{where}.devices[]", d, low=0)
        if gpu_count is not None and max(devices) >= gpu_count:
            raise ProfileError(f"{where}.devices: GPU {max(devices)} is out of range, {gpu_count} GPU(s) visible"
                               + (f" (0-{gpu_count - 1})" if gpu_count else ""))  # fmt: skip
    if "sampling" in values and not isinstance(values["sampling"], dict):
        raise ProfileError(f"{where}.sampling must be a mapping, got {values['sampling']!r}")
    return StageProfile(name, **values)


def _check_sampling(where: str, raw: dict, max_seq_len: int) -> None:
    values = {"max_tokens": max(1, max_seq_len // 2), **raw}  # the stages' own default is at most this
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    try:
        SamplingParams(**values, max_tokens_given=True).validate().fit_to_context(0, max_seq_len)
    except TypeError as e:
        raise ProfileError(f"{where}.sampling: {e}".replace("SamplingParams.__init__() ", "")) from None
    except OmniError as e:
        raise ProfileError(f"{where}.sampling: {e}") from None


def _check_memory(stages: dict[str, StageProfile]) -> None:
    per_gpu: dict[int, list[tuple[str, float]]] = {}
    for stage in stages.values():
        if stage.memory_fraction is not None:
            for gpu in stage.replica_devices():
                per_gpu.setdefault(gpu, []).append((stage.name, float(stage.memory_fraction)))
    for gpu, parts in sorted(per_gpu.items()):
        total = sum(f for _, f in parts)
        if total > 1.0 + 1e-9:
            listed = ", ".join(f"{n} {f:g}" for n, f in parts)
            raise ProfileError(f"GPU {gpu}: memory_fraction of its stage instances adds up to {total:g} ({listed}); "
                               "it must be <= 1")  # fmt: skip
