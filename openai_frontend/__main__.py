# python -m openai_frontend --triton-url 127.0.0.1:8001 [--triton-url HOST:PORT ...] --host 127.0.0.1 --port 8091
from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from omnistage.core.protocol import OMNI, TRITON_GRPC_KEY_HEADER, TRITON_KEY_ENV
from omnistage.core.voices import DEFAULT_VOICE

from openai_frontend.app import create_app
from openai_frontend.middleware import BoundedH11Protocol, BoundedWebSocketProtocol
from openai_frontend.realtime.connection import RealtimeLimits
from openai_frontend.realtime.events import MAX_EVENT_BYTES
from openai_frontend.settings import DEFAULT_VOICES, SERVED_MODEL_NAMES, MiB, RESPONSE_STYLES, FrontendSettings
from openai_frontend.stage_watchdog import StageWatchdog
from openai_frontend.triton_client import TritonOmniClient
from openai_frontend.triton_pool import client_for

API_KEY_ENV = "OMNISTAGE_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description="OpenAI-compatible frontend for omnistage")
    p.add_argument("--triton-url", action="append", default=None,
                   help="Triton gRPC endpoint host:port; repeat it to spread requests over several servers")
    p.add_argument("--probe-interval", type=float, default=2.0, help="seconds between readiness probes of the servers")
    p.add_argument("--triton-model", default=OMNI.name, help="Triton model to call")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a model id clients may send (repeat it for several; the first is the default); "
                        f"default: {' and '.join(SERVED_MODEL_NAMES)}")
    p.add_argument("--voices", default=",".join(DEFAULT_VOICES),
                   help="comma-separated voices of the served checkpoint (its talker speaker table)")
    p.add_argument("--default-voice", default=DEFAULT_VOICE, help="voice when a request names none")
    p.add_argument("--response-style", default="openai", choices=RESPONSE_STYLES,
                   help="response shape when a request does not set `response_style`")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; unset = open)")
    p.add_argument("--max-body-mb", type=float, default=64, help="larger request bodies get 413")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) image_url / audio_url URLs (off: only data: URLs are accepted)")
    p.add_argument("--remote-media-timeout", type=float, default=10.0, help="seconds per remote media fetch")
    p.add_argument("--remote-media-max-mb", type=float, default=20, help="size cap of one fetched media file")
    p.add_argument("--audio-expiry-s", type=int, default=3600,
                   help="a spoken reply's audio.id can be referred to by later requests for this long")
    p.add_argument("--audio-keep", type=int, default=1024, help="at most this many spoken replies are kept")
    p.add_argument("--audio-keep-mb", type=float, default=64,
                   help="at most this much transcript text of spoken replies is kept")
    p.add_argument("--remote-media-allow-network", action="append", default=[], metavar="CIDR",
                   help="a network remote media may come from besides public addresses (repeatable)")
    p.add_argument("--max-audio-seconds", type=float, default=600.0,
                   help="longest input audio clip; compressed audio is decoded only up to it")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--no-stage-probes", action="store_true",
                   help="readiness from Triton's model readiness only: no probe requests to every model, no "
                        "reload of a model whose stub process died (see docs/reliability.md)")
    p.add_argument("--probe-timeout", type=float, default=10.0, help="a probe not answered in this time fails")
    p.add_argument("--no-reload", action="store_true",
                   help="probe, but do not reload a model whose stub died (reloading needs Triton's "
                        "--model-control-mode=explicit)")
    limits = RealtimeLimits()
    p.add_argument("--realtime-max-sessions", type=int, default=limits.max_sessions,
                   help="open /v1/realtime sessions; one more gets an error event and a close")
    p.add_argument("--realtime-idle-timeout", type=float, default=limits.idle_timeout_s,
                   help="seconds a realtime session may send nothing (with no response running) before it is closed")
    p.add_argument("--realtime-max-buffered-audio", type=float, default=limits.max_buffered_audio_s,
                   help="seconds of uncommitted input audio a realtime session may hold")
    p.add_argument("--realtime-max-conversation-tokens", type=int, default=limits.max_conversation_tokens,
                   help="tokens a realtime conversation may reach (prompt + reply) before it is closed")
    p.add_argument("--realtime-max-conversation-mb", type=float, default=limits.max_conversation_mb,
                   help="text, images and audio a realtime conversation's items may hold before it is closed")
    p.add_argument("--max-connections", type=int, default=2048,
                   help="open connections and requests beyond this are answered 503 at once")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open for the client's next request; behind a load "
                        "balancer that reuses connections, set it above the balancer's idle timeout")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are cancelled")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> FrontendSettings:
    try:
        return FrontendSettings(
            served_model_names=tuple(args.served_model_name or SERVED_MODEL_NAMES),
            voices=tuple(args.voices.split(",")),
            default_voice=args.default_voice,
            response_style=args.response_style,
            api_key=args.api_key or None,
            max_body_bytes=int(args.max_body_mb * MiB),
            fetch_remote_media=args.allow_remote_media,
            fetch_timeout_s=args.remote_media_timeout,
            fetch_max_bytes=int(args.remote_media_max_mb * MiB),
            audio_keep_s=args.audio_expiry_s,
            audio_keep_count=args.audio_keep,
            audio_keep_bytes=int(args.audio_keep_mb * MiB),
            fetch_allowed_networks=tuple(args.remote_media_allow_network),
            max_audio_seconds=args.max_audio_seconds,
        )
    except ValueError as exc:
        raise SystemExit(f"python -m openai_frontend: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    urls = args.triton_url or ["127.0.0.1:8001"]

    # the key of Triton's restricted APIs (omnistage.launch.serve sets it; one key for every server)
    headers = {TRITON_GRPC_KEY_HEADER: os.environ[TRITON_KEY_ENV]} if os.environ.get(TRITON_KEY_ENV) else {}

    def make(url: str) -> TritonOmniClient:
        watchdog = None if args.no_stage_probes else StageWatchdog(
            url, interval_s=args.probe_interval, timeout_s=args.probe_timeout, reload=not args.no_reload,
            headers=headers)
        return TritonOmniClient(url, model_name=args.triton_model, watchdog=watchdog, headers=headers)

    client = client_for(urls, make, args.probe_interval)
    app = create_app(client, settings)
    try:
        app.state.realtime_limits = RealtimeLimits(args.realtime_max_sessions, args.realtime_idle_timeout,
                                                   args.realtime_max_buffered_audio,
                                                   args.realtime_max_conversation_tokens,
                                                   args.realtime_max_conversation_mb)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"python -m openai_frontend: {exc}") from None
    # uvicorn's graceful shutdown: stop accepting, let in-flight requests (streams included) finish for up
    # to the timeout, then cancel them (which cancels their Triton requests)
    # a deadline for request heads (BoundedH11Protocol) and bodies (BodyLimit), one for clients that stop
    # reading (both protocols), a cap on connections
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=BoundedH11Protocol,
                ws=BoundedWebSocketProtocol, limit_concurrency=args.max_connections,
                timeout_keep_alive=args.keep_alive_timeout, timeout_graceful_shutdown=args.shutdown_timeout,
                ws_max_size=MAX_EVENT_BYTES)  # fmt: skip


if __name__ == "__main__":
    main()
