# Session fixtures shared by unit and Triton tests: the tiny checkpoint and transformers' reference model.
import pytest
import torch


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from omnistage.models.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def processor(tiny_checkpoint):
    from omnistage.models.processor import load_processor

    return load_processor(tiny_checkpoint)
