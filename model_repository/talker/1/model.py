from omnistage.triton.talker_model import TalkerModel as TritonPythonModel  # noqa: F401
