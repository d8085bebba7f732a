from omnistage.triton.thinker_model import ThinkerModel as TritonPythonModel  # noqa: F401
