# The frontend in front of two tritonservers (tiny checkpoint, CPU, loopback), with the openai SDK:
# requests spread over both servers, and once one is killed every request still succeeds on the other.
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from .. import oracle
from ..api.servers import FrontendProcess
from .conftest import RepoSpec
from .test_omni_pipeline import infer_count

REQUEST = dict(model="qwen3-omni", modalities=["text"], max_tokens=3, temperature=0)


@pytest.fixture
def servers(tiny_checkpoint, triton_launcher):
    spec = RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository",
                    ready_timeout_s=300)  # two servers load side by side on 2 cores  # fmt: skip
    return triton_launcher.start_all([spec, spec])


def ask(client: openai.OpenAI, i: int) -> str:
    completion = client.chat.completions.create(messages=oracle.messages("text", f"Say hello {i}"), **REQUEST)
    assert completion.choices[0].finish_reason == "length"
    return completion.choices[0].message.content


def served(servers) -> list[int]:
    counts = []
    for s in servers:
        client = s.grpc_client()
        counts.append(infer_count(client, "omni_ensemble"))
    return counts


def test_requests_spread_and_survive_a_dead_server(servers):
    urls = [a for s in servers for a in ("--triton-url", s.grpc_url)]
    # no stage probes: they are omni_ensemble inferences too, and the counts below are of requests
    with FrontendProcess(*urls, "--probe-interval", "0.5", "--no-stage-probes") as frontend:
        client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: ask(client, i), range(8)))
        assert all(replies)
        counts = served(servers)
        assert sum(counts) == 8 and min(counts) >= 2, counts  # both servers took a share

        servers[0].server.stop()  # killed: its requests must move to the other server
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: ask(client, i), range(8)))
        assert all(replies)
        assert served(servers[1:]) == [counts[1] + 8]
        assert httpx.get(f"{frontend.url}/health", timeout=10).status_code == 200
    assert "taken out of the pool" in frontend.output
