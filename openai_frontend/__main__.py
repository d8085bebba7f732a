# python -m openai_frontend --triton-url 127.0.0.1:8001 [--triton-url HOST:PORT ...] --host 127.0.0.1 --port 8091
from __future__ import annotations

import argparse
import logging

import uvicorn

from omnistage.core.protocol import OMNI

from openai_frontend.app import create_app
from openai_frontend.schemas import VOICES
from openai_frontend.triton_client import TritonOmniClient
from openai_frontend.triton_pool import client_for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description="OpenAI-compatible frontend for omnistage")
    p.add_argument("--triton-url", action="append", default=None,
                   help="Triton gRPC endpoint host:port; repeat it to spread requests over several servers")
    p.add_argument("--probe-interval", type=float, default=2.0, help="seconds between readiness probes of the servers")
    p.add_argument("--triton-model", default=OMNI.name, help="Triton model to call")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--model-name", default="qwen3-omni", help="model id clients send and see")
    p.add_argument("--default-voice", default="ethan", choices=VOICES)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    urls = args.triton_url or ["127.0.0.1:8001"]
    client = client_for(urls, lambda url: TritonOmniClient(url, model_name=args.triton_model), args.probe_interval)
    app = create_app(client, default_voice=args.default_voice, model_name=args.model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
