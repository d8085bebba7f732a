#!/usr/bin/env python
# Calls omni_ensemble directly over Triton's gRPC streaming API (no OpenAI frontend): prints the text
# deltas as they arrive, writes the audio chunks to a WAV file, and prints finish_reason and usage.
# Against `serve`, whose Triton answers inference only with its key, set OMNISTAGE_TRITON_KEY to the key the
# server was started with (docs/reliability.md#security).
#
#   python tools/omni_grpc_client.py --url 127.0.0.1:8001 --prompt "Say hello!" --max-tokens 8 \
#       --talker-max-tokens 50 --param talker_ignore_eos=true --out reply.wav
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import wave
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from omnistage.core.protocol import OMNI, SAMPLE_RATE, TRITON_GRPC_KEY_HEADER, TRITON_KEY_ENV


def _string(result, name: str) -> str | None:
    value = result.as_numpy(name)
    return None if value is None else value.reshape(-1)[0].decode("utf-8")


def _value(text: str):
    # Triton parameters are str / int / float / bool; lists (stop_token_ids) travel as JSON strings
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, (str, int, float, bool)) else text


def main() -> int:
    ap = argparse.ArgumentParser(description="stream one omni_ensemble request over Triton gRPC")
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    ap.add_argument("--prompt", default="Say hello!")
    ap.add_argument("--modalities", default="text,audio", help="text, audio or text,audio")
    ap.add_argument("--speaker", default="ethan")
    ap.add_argument("--max-tokens", type=int, help="reply tokens (thinker)")
    ap.add_argument("--talker-max-tokens", type=int, help="codec frames (talker), 12.5 per second of audio")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other request parameter, e.g. talker_ignore_eos=true (JSON value if it parses)",
    )
    ap.add_argument("--out", default="reply.wav", help="WAV file for the audio")
    args = ap.parse_args()

    messages = [{"role": "user", "content": args.prompt}]
    spec = OMNI.input("messages")
    inputs = [grpcclient.InferInput(spec.name, list(spec.dims), "BYTES")]
    inputs[0].set_data_from_numpy(np.array([json.dumps(messages).encode("utf-8")], dtype=np.object_))
    # request parameters: str / int / float / bool; see the omni_ensemble table in docs/architecture.md
    parameters = {"modalities": args.modalities, "speaker": args.speaker}
    if args.max_tokens is not None:
        parameters["max_tokens"] = args.max_tokens
    if args.talker_max_tokens is not None:
        parameters["talker_max_tokens"] = args.talker_max_tokens
    for item in args.param:
        name, _, value = item.partition("=")
        parameters[name] = _value(value)

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    key = os.environ.get(TRITON_KEY_ENV)
    client.start_stream(callback=lambda result, error: responses.put((result, error)),
                        headers={TRITON_GRPC_KEY_HEADER: key} if key else None)
    try:
        # enable_empty_final_response: the end of the stream is a response flagged triton_final_response
        client.async_stream_infer(OMNI.name, inputs, parameters=parameters, enable_empty_final_response=True)
    except InferenceServerException:
        pass  # the stream broke before the request went out (a refused key): its error is in the queue

    audio, finish_reason, usage, error = [], None, None, None
    while True:
        result, err = responses.get(timeout=600)
        if err is not None:  # "[400] message" for a bad request, "[500] ..." for an engine failure
            error = err.message()
            break
        if (text := _string(result, "text")) is not None:
            print(text, end="", flush=True)
        if (chunk := result.as_numpy("audio")) is not None and chunk.size:
            audio.append(chunk.astype(np.float32))
        finish_reason = _string(result, "finish_reason") or finish_reason
        if (raw := _string(result, "usage")) is not None:
            usage = json.loads(raw)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    client.close()
    print()
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        if TRITON_GRPC_KEY_HEADER in error:
            print(f"Triton wants its key: set {TRITON_KEY_ENV} to the key the server was started with "
                  "(or start `serve` with --triton-open-inference)", file=sys.stderr)
        return 1

    print(f"finish_reason: {finish_reason}")
    print(f"usage: {json.dumps(usage)}")
    if audio:
        samples = np.concatenate(audio)
        pcm16 = np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        with wave.open(args.out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(pcm16.tobytes())
        print(f"audio: {len(audio)} chunks, {samples.size} samples ({samples.size / SAMPLE_RATE:.2f} s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
