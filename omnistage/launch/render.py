# Renders a Triton model repository: config.pbtxt generated from the tensor contracts in
# omnistage.core.protocol plus a per-model deployment spec, next to a copy of each model's version dir.
#
#   python -m omnistage.launch.render --model checkpoints/tiny --device cpu --out .run/model_repository
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.core.protocol import CONTRACTS, ModelContract, TensorSpec
from omnistage.launch.triton_env import REPO_ROOT

KINDS = ("KIND_CPU", "KIND_GPU")


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
    """The four stages for one checkpoint (a dir, or `dummy:<config.json>`) on cpu or cuda."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    cuda = device == "cuda"
    common = {"model_path": absolute_model_path(model_path), "device": device, "dtype": "bfloat16" if cuda else "float32"}
    engine = {"max_batch_size": "64" if cuda else "8", "max_seq_len": "4096" if cuda else "1024"}
    if cuda:  # transformers' grouped-GEMM experts instead of its per-expert Python loop (host-bound on GPU)
        engine["experts_implementation"] = "grouped_mm"
        engine["cuda_graphs"] = "1"  # decode steps replayed as CUDA graphs per batch / context bucket
    gpu = {"kind": "KIND_GPU", "gpus": (0,)} if cuda else {}
    return {
        "thinker": ModelSpec(parameters={**common, **engine}, **gpu),
        "talker": ModelSpec(parameters={**common, **engine}, **gpu),
        # windows from many talker streams are batched by code2wav's own engine thread (execute()
        # only enqueues), not by Triton: see ModelSpec.max_batch_size
        "code2wav": ModelSpec(parameters={**common, "max_batch_windows": "64"}, **gpu),
        # the orchestrator only moves tensors between stages (BLS); it holds no weights
        "omni_ensemble": ModelSpec(
            parameters={**common, "first_chunk_frames": "4", "chunk_frames": "25", "max_inflight": "128"}
        ),
    }


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__ or "render the omnistage model repository")
    ap.add_argument("--model", required=True, help="checkpoint dir or dummy:<config.json>")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--src", type=Path, default=REPO_ROOT / "model_repository", help="dir of <model>/1/model.py")
    ap.add_argument("--link", action="store_true", help="symlink the version dirs' files instead of copying")
    args = ap.parse_args(argv)
    out = render_repository(args.src, args.out, default_spec(args.model, args.device), link=args.link)
    print(out)


if __name__ == "__main__":
    main()
