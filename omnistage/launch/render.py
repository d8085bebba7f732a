# Renders a Triton model repository: config.pbtxt generated from the tensor contracts in
# omnistage.core.protocol plus a per-model deployment spec (from a deploy profile, deploy/*.yaml), next
# to a copy of each model's version dir. The checked-in model_repository/ is the base profile on the cpu
# platform with the tiny checkpoint (checkpoints/tiny, relative to the repository), rendered in place.
#
#   python -m omnistage.launch.render --model checkpoints/tiny --device cpu --out .run/model_repository
#   python -m omnistage.launch.render --profile deploy/overlays/reference_3gpu.yaml --model <ckpt> --out <repo>
#   python -m omnistage.launch.render --checked-in      (rewrites model_repository/*/config.pbtxt)
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.core.chunking import ChunkSchedule
from omnistage.core.protocol import CONTRACTS, ModelContract, TensorSpec
from omnistage.launch.profile import (
    BASE_PROFILE, ENGINE_STAGES, PLATFORMS, Profile, ProfileError, load_profile, visible_gpu_count,
)
from omnistage.launch.triton_env import REPO_ROOT

KINDS = ("KIND_CPU", "KIND_GPU")
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# the checked-in repository's checkpoint, relative to the repository root (models resolve it there, and a
# launcher's render writes an absolute path instead)
CHECKED_IN_MODEL = "checkpoints/tiny"


@dataclass
class ModelSpec:
    instances: int = 1
    kind: str = "KIND_CPU"
    gpus: tuple[int, ...] = ()  # KIND_GPU only; empty = every visible GPU (Triton's default)
    parameters: dict[str, str] = field(default_factory=dict)  # config `parameters`, read by model.py
    # Triton-side batching (measured on 2.51, tests/triton/test_server_smoke.py): with
    # max_batch_size 0 every execute() gets one request, dynamic_batching or not (Triton accepts the
    # block silently). Requests queued while an instance is busy reach one execute() together only
    # with max_batch_size > 0 plus dynamic_batching; then every tensor carries a leading batch dim
    # of 1 on the wire, and requests of different shapes are only grouped with allow_ragged_batch
    # (set on every input here: the Python backend never concatenates, so raggedness is free).
    # A decoupled stage whose execute() only enqueues gains nothing from this: its engine thread
    # batches whatever has queued since its last step.
    max_batch_size: int = 0
    queue_delay_us: int | None = None  # None: no dynamic_batching block
    contract: ModelContract | None = None  # default: CONTRACTS[name]
    source: str | None = None  # model dir under src to copy; default: the model's own name


def default_spec(model_path: str, device: str) -> dict[str, ModelSpec]:
    """The four stages for one checkpoint (a dir, or `dummy:<config.json>`) on cpu or cuda: the base profile."""
    if device not in PLATFORMS:
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    return profile_spec(load_profile(BASE_PROFILE, device), model_path)


def checked_in_spec() -> dict[str, ModelSpec]:
    """What model_repository/ holds: the base profile on the cpu platform over the tiny checkpoint."""
    return profile_spec(load_profile(BASE_PROFILE, "cpu"), CHECKED_IN_MODEL, resolve_model=False)


def checked_in_configs() -> dict[str, str]:
    """Model name -> the text of its config.pbtxt in model_repository/."""
    header = ("# Rendered from deploy/qwen3_omni_moe.yaml (platform cpu) by `python -m omnistage.launch.render "
              "--checked-in`:\n# change the profile and render again rather than editing this file.\n")  # fmt: skip
    return {name: header + render_config(name, spec) for name, spec in checked_in_spec().items()}


def write_checked_in(repo: Path = MODEL_REPOSITORY) -> list[Path]:
    """Writes each model's config.pbtxt of checked_in_spec() beside its version dir, in place."""
    written = []
    for name, text in checked_in_configs().items():
        path = repo / name / "config.pbtxt"
        path.write_text(text)
        written.append(path)
    return written


def profile_spec(profile: Profile, model_path: str | None = None, resolve_model: bool = True) -> dict[str, ModelSpec]:
    """Model name -> ModelSpec for a deploy profile. Thinker, talker and code2wav replicas are separate
    models (`talker`, `talker_1`, ...), one instance each, because their requests are stateful sessions
    (start, append, abort) and a BLS call cannot pick an instance; omni_ensemble pins each session to one of
    them (their names go to it as parameters). resolve_model: the checkpoint path made absolute against the
    caller's working directory (else kept as given)."""
    model_path = model_path or profile.model
    if not model_path:
        raise ValueError("no model: pass one, or set `model:` in the profile")
    cuda = profile.platform == "cuda"
    model_path = absolute_model_path(model_path) if resolve_model else str(model_path)
    common = {"model_path": model_path, "device": profile.platform, "dtype": profile.dtype}
    chunks = profile.chunks
    spec: dict[str, ModelSpec] = {}
    for stage in ENGINE_STAGES:
        plan = profile.stages[stage]
        params = {**common, **_parameters(plan, ("max_batch_size", "max_seq_len", "max_queue", "memory_fraction",
                                                 "kv_cache_bytes", "prefix_cache_bytes"))}  # fmt: skip
        if plan.sampling:
            params["sampling_defaults"] = json.dumps(plan.sampling, sort_keys=True)
        for name, gpu in zip(plan.replica_names(), plan.replica_devices()):
            place = {"kind": "KIND_GPU", "gpus": (gpu,)} if cuda else {}
            spec[name] = ModelSpec(parameters=dict(params), source=stage, contract=CONTRACTS[stage], **place)
    plan = profile.stages["code2wav"]
    # max_batch_size is the engine's, not Triton's (see ModelSpec); the first lane decodes new streams' first
    # chunks of these lengths (CUDA graphs on cuda), the main lane the others, of up to chunk_frames. Realtime
    # replies start with the playback schedule's first chunk: in the main lane it waited behind later chunks
    firsts = {chunks.first_chunk_frames, chunks.light_first_chunk_frames} - {None}
    firsts |= {ChunkSchedule(n, chunks.chunk_frames).for_playback().first_chunk_frames for n in firsts}
    params = {**common, **_parameters(plan, ("memory_fraction",)), "max_batch_windows": str(plan.max_batch_size or 64),
              "first_chunk_frames": ",".join(map(str, sorted(firsts))), "chunk_frames": str(chunks.chunk_frames)}  # fmt: skip
    for name, gpu in zip(plan.replica_names(), plan.replica_devices()):
        place = {"kind": "KIND_GPU", "gpus": (gpu,)} if cuda else {}
        spec[name] = ModelSpec(parameters=dict(params), source="code2wav", contract=CONTRACTS["code2wav"], **place)
    omni = profile.stages["omni_ensemble"]
    spec["omni_ensemble"] = ModelSpec(
        instances=omni.replicas,
        parameters={
            **common,
            "first_chunk_frames": str(chunks.first_chunk_frames),
            "chunk_frames": str(chunks.chunk_frames),
            # a smaller first chunk while the server is nearly idle (core/chunking.py ChunkPolicy); unset: off
            **({"light_first_chunk_frames": str(chunks.light_first_chunk_frames),
                "light_load_requests": str(chunks.light_load_requests)}
               if chunks.light_first_chunk_frames is not None else {}),
            "max_inflight": str(omni.max_inflight or 128),
            "max_queue": str(omni.max_queue or 256),
            # request media limits (omnistage.models.media.MediaLimits); unset: its defaults
            **{k: str(v) for k, v in omni.media.items()},
            **{f"{s}_models": ",".join(profile.stages[s].replica_names()) for s in (*ENGINE_STAGES, "code2wav")},
        },
    )
    set_ensemble_contexts(spec)
    return spec


def set_ensemble_contexts(spec: dict[str, ModelSpec]) -> None:
    """Gives omni_ensemble the thinker's and talker's contexts, which it checks requests against before any
    stage starts: text untokenized against the thinker's, the talker's prompt at admission against the
    talker's. Called again by whoever changes a stage's max_seq_len in a rendered spec."""
    ensemble = spec["omni_ensemble"].parameters
    ensemble["max_prompt_tokens"] = spec["thinker"].parameters["max_seq_len"]
    ensemble["talker_max_seq_len"] = spec["talker"].parameters["max_seq_len"]


def _parameters(plan, keys: tuple[str, ...]) -> dict[str, str]:
    """The stage's values of `keys` as config parameters; unset ones are left to the model's own default."""
    return {key: str(getattr(plan, key)) for key in keys if getattr(plan, key) is not None}


def absolute_model_path(model_path: str) -> str:
    # model.py runs with the server's working directory, not the caller's
    prefix = "dummy:" if str(model_path).startswith("dummy:") else ""
    return prefix + str(Path(str(model_path).removeprefix(prefix)).resolve())


def _quote(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid protobuf text-format string literal


def _tensor(t: TensorSpec, ragged: bool = False) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    extra = (" optional: true" if t.optional else "") + (" allow_ragged_batch: true" if ragged else "")
    return f"  {{ name: {_quote(t.name)} data_type: {t.data_type} dims: [ {dims} ]{extra} }}"


def render_config(name: str, spec: ModelSpec) -> str:
    contract = spec.contract or CONTRACTS[name]
    if spec.kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {KINDS}, not {spec.kind!r}")
    if spec.instances < 1:
        raise ValueError(f"{name}: instances must be >= 1")
    if spec.max_batch_size < 0:
        raise ValueError(f"{name}: max_batch_size must be >= 0")
    batched = spec.max_batch_size > 0
    lines = [
        f"name: {_quote(name)}",
        'backend: "python"',
        # 0 (the default): the stages take variable-length tensors without a batch dim and batch
        # inside their own engines, so Triton must neither add nor split one
        f"max_batch_size: {spec.max_batch_size}",
    ]
    if contract.decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines.append("input [\n" + ",\n".join(_tensor(t, ragged=batched) for t in contract.inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(_tensor(t) for t in contract.outputs) + "\n]")
    gpus = f" gpus: [ {', '.join(map(str, spec.gpus))} ]" if spec.kind == "KIND_GPU" and spec.gpus else ""
    lines.append(f"instance_group [ {{ count: {spec.instances} kind: {spec.kind}{gpus} }} ]")
    if spec.queue_delay_us is not None:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {int(spec.queue_delay_us)} }}")
    for key, value in sorted(spec.parameters.items()):
        lines.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(str(value))} }} }}")
    return "\n".join(lines) + "\n"


def render_repository(src_dir: Path, out_dir: Path, spec: dict[str, ModelSpec], link: bool = False) -> Path:
    """Writes out_dir/<model>/config.pbtxt and copies (or symlinks) src_dir/<source>/1/.

    out_dir is replaced as a whole so that models dropped from spec do not linger in it.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    configs = {name: render_config(name, s) for name, s in spec.items()}  # validate before touching out_dir
    missing = [n for n, s in spec.items() if not (src_dir / (s.source or n) / "1" / "model.py").is_file()]
    if missing:
        raise FileNotFoundError(f"no <model>/1/model.py under {src_dir} for: {', '.join(missing)}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    for name, s in spec.items():
        version_src, version_out = src_dir / (s.source or name) / "1", out_dir / name / "1"
        version_out.parent.mkdir(parents=True)
        (out_dir / name / "config.pbtxt").write_text(configs[name])
        if link:  # edits to model.py take effect on the next server start without re-rendering
            version_out.mkdir()
            for entry in version_src.iterdir():
                if entry.name != "__pycache__":
                    (version_out / entry.name).symlink_to(entry.resolve())
        else:
            shutil.copytree(version_src, version_out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return out_dir


def add_profile_args(ap: argparse.ArgumentParser) -> None:
    """--profile / --device / --gpus, shared by render and serve."""
    ap.add_argument("--profile", type=Path, default=BASE_PROFILE, help="deploy profile YAML (default: the base)")
    ap.add_argument("--device", choices=PLATFORMS, default=None,
                    help="platform block of the profile to apply (default: the profile's `platform:`)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs the server will see, for checking the profile (default: detected)")


def spec_from_args(args: argparse.Namespace) -> tuple[Profile, dict[str, ModelSpec]]:
    """Loads the profile the flags name; a ProfileError ends the program with its message."""
    try:
        profile = load_profile(args.profile, args.device, args.gpus if args.gpus is not None else visible_gpu_count())
        return profile, profile_spec(profile, args.model)
    except (ProfileError, ValueError) as e:
        raise SystemExit(f"{args.profile}: {e}") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m omnistage.launch.render",
                                 description="render the omnistage model repository from a deploy profile")
    ap.add_argument("--model", default=None, help="checkpoint dir or dummy:<config.json> (default: the profile's)")
    add_profile_args(ap)
    ap.add_argument("--out", type=Path, help="the repository to write (replaced as a whole)")
    ap.add_argument("--src", type=Path, default=MODEL_REPOSITORY, help="dir of <model>/1/model.py")
    ap.add_argument("--link", action="store_true", help="symlink the version dirs' files instead of copying")
    ap.add_argument("--checked-in", action="store_true",
                    help="rewrite model_repository/*/config.pbtxt from the base profile (cpu, checkpoints/tiny)")
    args = ap.parse_args(argv)
    if args.checked_in:
        for path in write_checked_in():
            print(path)
        return
    if args.out is None:
        ap.error("--out is required (or --checked-in)")
    _, spec = spec_from_args(args)
    out = render_repository(args.src, args.out, spec, link=args.link)
    print(out)


if __name__ == "__main__":
    main()
