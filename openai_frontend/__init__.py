# OpenAI-compatible HTTP frontend for omnistage. It reaches Triton only over gRPC, through the
# `OmniClient` interface (omni_client.py), so tests can drive it with a fake. Nothing is imported
# here on purpose: `python -m openai_frontend` and the tests import the modules they need.
