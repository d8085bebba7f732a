# The tritonclient adapter's pure parts: parameters and tensors out, real InferResult objects in.
import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import deserialize_bytes_tensor

from omnistage.core.errors import BadRequestError, EngineError, OverloadedError
from omnistage.core.protocol import OMNI
from openai_frontend.triton_codec import ResponseDecoder, encode_parameters, error_from_message, stream_request

from .fake_triton import infer_response


def test_parameters_take_the_contract_types():
    got = encode_parameters({
        "modalities": "text,audio", "speaker": "ethan", "max_tokens": 16, "temperature": 1,
        "top_p": 0.5, "seed": 3, "ignore_eos": True, "stop_token_ids": [1, 2],
        "talker_max_tokens": 99, "talker_temperature": 0.9, "talker_stop_token_ids": "[5]", "top_k": None,
    })
    assert got == {
        "modalities": "text,audio", "speaker": "ethan", "max_tokens": 16, "temperature": 1.0,
        "top_p": 0.5, "seed": 3, "ignore_eos": True, "stop_token_ids": "[1, 2]",
        "talker_max_tokens": 99, "talker_temperature": 0.9, "talker_stop_token_ids": "[5]",
    }
    assert isinstance(got["temperature"], float)  # sent as double_param, not int64_param


def test_unknown_parameter_is_a_programming_error():
    with pytest.raises(ValueError, match="not a parameter"):
        encode_parameters({"beam_width": 4})


def test_request_on_the_wire():
    messages = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    req = stream_request(messages, {"temperature": 0.0, "speaker": "aiden"}, model_name=OMNI.name, request_id="r-1")
    proto = _get_inference_request(
        model_name=req["model_name"], inputs=req["inputs"], model_version="", request_id=req["request_id"],
        outputs=None, sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None,
        parameters=req["parameters"],
    )
    assert proto.model_name == "omni_ensemble" and proto.id == "r-1"
    (tensor,) = proto.inputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("messages", "BYTES", [1])
    assert json.loads(deserialize_bytes_tensor(proto.raw_input_contents[0])[0]) == messages
    assert proto.parameters["temperature"].double_param == 0.0
    assert proto.parameters["speaker"].string_param == "aiden"
    assert proto.parameters["triton_enable_empty_final_response"].bool_param is True


def test_decode_responses():
    decoder = ResponseDecoder()
    audio = np.linspace(-1, 1, 7, dtype=np.float32)
    chunk, final = decoder.decode(InferResult(infer_response(text="Hi", token_ids=[9, 10], audio=audio)))
    assert not final and chunk.text == "Hi" and chunk.token_ids == [9, 10] and chunk.finish_reason is None
    assert chunk.audio.dtype == np.float32 and np.array_equal(chunk.audio, audio)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "audio_frames": 3}
    chunk, final = decoder.decode(InferResult(infer_response(finish_reason="length", usage=usage, final=True)))
    assert final and chunk.finish_reason == "length" and chunk.usage == usage and chunk.audio is None


def test_finish_reason_before_an_empty_final_response():
    decoder = ResponseDecoder()
    chunk, final = decoder.decode(InferResult(infer_response(text="x", finish_reason="stop", usage={"prompt_tokens": 1})))
    assert not final and chunk.finish_reason is None  # held until the final flag
    chunk, final = decoder.decode(InferResult(infer_response(final=True)))
    assert final and chunk.finish_reason == "stop" and chunk.usage == {"prompt_tokens": 1} and chunk.text == ""


def test_utf8_split_across_responses():
    decoder = ResponseDecoder()
    raw = "añ€".encode()
    texts = []
    for piece in (raw[:2], raw[2:4], raw[4:]):
        r = infer_response(final=False)
        out = r.outputs.add(name="text", datatype="BYTES")
        out.shape.append(1)
        r.raw_output_contents.append(len(piece).to_bytes(4, "little") + piece)
        texts.append(decoder.decode(InferResult(r))[0].text)
    assert "".join(texts) == "añ€"


@pytest.mark.parametrize("message, kind, code, text", [
    ("[400] image could not be decoded", BadRequestError, 400, "image could not be decoded"),
    ("[503] queue full", OverloadedError, 503, "queue full"),
    ("[413] prompt too long", EngineError, 413, "prompt too long"),
    ("in ensemble 'omni_ensemble', model crashed", EngineError, 500, "in ensemble 'omni_ensemble', model crashed"),
])
def test_error_messages(message, kind, code, text):
    err = error_from_message(message)
    assert type(err) is kind and err.code == code and str(err) == text
