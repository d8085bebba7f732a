from omnistage.triton.code2wav_model import Code2WavModel as TritonPythonModel  # noqa: F401
