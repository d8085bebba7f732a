from omnistage.triton.omni_model import OmniModel as TritonPythonModel  # noqa: F401
