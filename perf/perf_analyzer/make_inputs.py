# perf_analyzer --input-data files for omni_ensemble and for each stage model (see README.md here).
#   offline : omni_w1.json, omni_w2.json (messages), thinker_w1.json (input_ids); model-independent,
#             since every checkpoint here shares the Qwen3 tokenizer and chat template.
#   stages  : talker_w1.json, which holds model tensors (hidden size) taken from a running server (the
#             thinker is run once over gRPC with export_talker to get the talker's start tensors), and
#             code2wav_{first,chunk}.json: a first chunk and a main chunk of codec frames.
#
#   python -m perf.perf_analyzer.make_inputs offline --out perf/perf_analyzer
#   python -m perf.perf_analyzer.make_inputs stages --url 127.0.0.1:8001 --out /tmp/pa
#
# A server that `serve` started answers inference only with its Triton key: OMNISTAGE_TRITON_KEY, when set,
# goes with every request (docs/reliability.md#security).
from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import sys
from pathlib import Path

import numpy as np

from omnistage.core.protocol import TRITON_GRPC_KEY_HEADER, TRITON_KEY_ENV
from omnistage.core.chunking import ChunkSchedule
from perf import workloads

HERE = Path(__file__).resolve().parent


def tensor_json(array: np.ndarray) -> dict:
    """perf_analyzer's explicit form: raw little-endian bytes in base64 plus the shape."""
    array = np.ascontiguousarray(array)
    data = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return {"content": {"b64": base64.b64encode(data).decode()}, "shape": list(array.shape)}


def omni_data(workload: workloads.Workload, n: int) -> dict:
    # messages is BYTES [1]: one JSON string per request
    return {"data": [{"messages": [json.dumps(workload.prompts[i % len(workload.prompts)])]} for i in range(n)]}


def thinker_data(workload: workloads.Workload, tokenizer, n: int) -> dict:
    rows = []
    for i in range(n):
        ids = tokenizer.apply_chat_template(
            workload.prompts[i % len(workload.prompts)], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        rows.append({"input_ids": {"content": list(ids), "shape": [len(ids)]}})
    return {"data": rows}


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({len(doc['data'])} requests, {path.stat().st_size // 1024} KiB)")


def offline(out: Path, n_w1: int, n_w2: int) -> None:
    tokenizer = workloads._tokenizer()
    w1 = workloads.w1(n_w1, tokenizer)
    write(out / "omni_w1.json", omni_data(w1, n_w1))
    write(out / "thinker_w1.json", thinker_data(w1, tokenizer, n_w1))
    write(out / "omni_w2.json", omni_data(workloads.w2(n_w2, tokenizer), n_w2))


# ---- stage tensors from a running server --------------------------------------------------------------
def triton_key() -> str | None:
    return os.environ.get(TRITON_KEY_ENV) or None


def _stream(url: str, model: str, inputs: dict, parameters: dict, timeout: float = 300.0) -> list[dict]:
    """One decoupled request; returns the responses as {output name: numpy array}."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    key = triton_key()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers={TRITON_GRPC_KEY_HEADER: key} if key else None)  # fmt: skip
    tensors = []
    for name, array in inputs.items():
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    try:
        client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
    except InferenceServerException:
        pass  # the stream broke before the request went out (a refused key): its error is in the queue
    responses = []
    try:
        while True:
            result, error = answers.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
            if outputs:
                responses.append(outputs)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def stages(url: str, out: Path, reply_tokens: int, seed: int = 0) -> None:
    tokenizer = workloads._tokenizer()
    w1 = workloads.w1(1, tokenizer)
    ids = np.array(
        tokenizer.apply_chat_template(w1.prompts[0], add_generation_prompt=True, tokenize=True)["input_ids"],
        dtype=np.int64,
    )
    params = {"max_tokens": reply_tokens, "ignore_eos": True, "temperature": "0", "export_talker": True}
    responses = _stream(url, "thinker", {"input_ids": ids}, params)
    first = next(r for r in responses if "talker_user_ids" in r)
    text_rows = np.concatenate(
        [r["text_rows"] for r in responses if r.get("text_rows") is not None and len(r["text_rows"])]
    )
    talker = {
        name: tensor_json(first[name])
        for name in ("talker_user_is_mm", "talker_user_ids", "talker_special_rows")
    }  # a text prompt has no talker_media_rows: the talker looks its rows up
    talker["text_rows"] = tensor_json(text_rows.astype(np.float32))
    write(out / "talker_w1.json", {"data": [talker]})
    users = first["talker_user_ids"].shape[0]
    print(f"  thinker gave {len(text_rows)} reply rows of width {text_rows.shape[1]}, {users} user rows")

    # Code2Wav: a request without a session is a stream of one chunk (perf_analyzer cannot carry a session from
    # one request to the next), so the main lane's chunk decodes without the state a stream's later chunks carry
    rng = np.random.default_rng(seed)
    codes = lambda n: rng.integers(0, 2048, size=(n, 16), dtype=np.int64)
    schedule = ChunkSchedule()
    write(out / "code2wav_first.json", {"data": [{"codes": tensor_json(codes(schedule.first_chunk_frames))}]})
    write(out / "code2wav_chunk.json", {"data": [{"codes": tensor_json(codes(schedule.chunk_frames))}]})


# ---- replaying an input file without perf_analyzer (a format check of the file alone) ------------------
_NP = {"BOOL": np.bool_, "INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP16": np.float16}


def decode_entry(entry: dict, datatypes: dict[str, str]) -> dict[str, np.ndarray]:
    """One `data` entry of an input file as numpy arrays, read the way perf_analyzer reads it."""
    out = {}
    for name, value in entry.items():
        kind = datatypes[name]
        if kind == "BYTES":
            out[name] = np.array([v.encode() for v in value], dtype=np.object_)
            continue
        content, shape = (value["content"], value.get("shape")) if isinstance(value, dict) else (value, None)
        if isinstance(content, dict):
            array = np.frombuffer(base64.b64decode(content["b64"]), dtype=np.dtype(_NP[kind]).newbyteorder("<"))
        else:
            array = np.array(content, dtype=_NP[kind])
        out[name] = array.reshape(shape) if shape is not None else array
    return out


def check(url: str, model: str, path: Path, parameters: dict) -> None:
    import tritonclient.grpc as grpcclient

    meta = grpcclient.InferenceServerClient(url).get_model_metadata(model, as_json=True)
    datatypes = {i["name"]: i["datatype"] for i in meta["inputs"]}
    for i, entry in enumerate(json.loads(path.read_text())["data"][:2]):
        responses = _stream(url, model, decode_entry(entry, datatypes), parameters)
        shapes = {k: list(v.shape) for k, v in responses[0].items()} if responses else {}
        print(f"{model} entry {i}: {len(responses)} responses; first: {shapes}")


def _param(text: str):
    name, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(value.lower(), value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.perf_analyzer.make_inputs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    off = sub.add_parser("offline", help="omni_w1 / omni_w2 / thinker_w1 (no server)")
    off.add_argument("--out", type=Path, default=HERE)
    off.add_argument("--w1-prompts", type=int, default=64)
    off.add_argument("--w2-prompts", type=int, default=8)
    st = sub.add_parser("stages", help="talker / code2wav inputs from a running server")
    st.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    st.add_argument("--out", type=Path, required=True)
    st.add_argument("--reply-tokens", type=int, default=18)
    ck = sub.add_parser("check", help="send the first entries of an input file to a server (no perf_analyzer)")
    ck.add_argument("--url", default="127.0.0.1:8001")
    ck.add_argument("--model", required=True)
    ck.add_argument("--input-data", type=Path, required=True)
    ck.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="request parameter")
    args = ap.parse_args(argv)
    if args.cmd == "offline":
        offline(args.out, args.w1_prompts, args.w2_prompts)
    elif args.cmd == "stages":
        stages(args.url, args.out, args.reply_tokens)
    else:
        check(args.url, args.model, args.input_data, dict(_param(p) for p in args.param))
    return 0


if __name__ == "__main__":
    sys.exit(main())
