"""`inflight serve`: the OpenAI-compatible server. Heavy imports (torch, FastAPI) happen in the handler."""

from __future__ import annotations

import argparse

from inflight.checkpoints.resolve import resolve_draft_model, resolve_model
from inflight.cli.args import add_listen_args, add_log_level_arg, add_model_arg, positive
from inflight.engine.cli_args import add_engine_args, engine_config_from_args
from inflight.server.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
)
from inflight.server.tool_parsers import PARSER_CHOICES


def register(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (continuous batching, Prometheus metrics)",
        description="Serve a Hugging Face Llama-family checkpoint over an OpenAI-compatible HTTP API. "
        "/health and /ready are the Kubernetes probes, /metrics is Prometheus text, /docs the API.",
    )
    add_model_arg(serve)
    add_engine_args(serve)
    serve.add_argument("--served-model-name", help="the model id clients send (default: --model as given)")
    serve.add_argument(
        "--tool-call-parser",
        choices=PARSER_CHOICES,
        default="auto",
        help="how tool calls are read from the output of tool_choice auto: hermes (<tool_call> blocks), "
        "llama3_json (Llama 3.1 JSON), auto (from the chat template; default)",
    )
    add_listen_args(serve, default_port=8000)
    serve.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="sequences that may wait for a slot beyond --max-slots; more get 429 "
        f"(default: {DEFAULT_MAX_QUEUE})",
    )
    serve.add_argument(
        "--api-key-file",
        help="require 'Authorization: Bearer KEY' with the key on this file's first line "
        "(default: $INFLIGHT_API_KEY; no key = no auth)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before exiting (default: 30)",
    )
    limits = serve.add_argument_group("limits (one client must not hurt the others; see docs/api.md)")
    limits.add_argument(
        "--max-body-bytes",
        type=positive(int),
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES} = 4 MiB)",
    )
    limits.add_argument(
        "--max-connections",
        type=positive(int),
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most; a new one beyond this closes the oldest idle or half-sent one "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )
    limits.add_argument(
        "--header-timeout",
        type=positive(float),
        default=DEFAULT_HEADER_TIMEOUT,
        help=f"seconds a client has to send a request's headers, else 408 + close "
        f"(default: {DEFAULT_HEADER_TIMEOUT:g})",
    )
    limits.add_argument(
        "--body-timeout",
        type=positive(float),
        default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds a client has to send a request's body after its headers, else 408 + close "
        f"(default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    add_log_level_arg(serve)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from inflight.server.auth import load_api_key
    from inflight.server.context import ServerSettings
    from inflight.server.limits import ConnectionLimits
    from inflight.server.run import bind_socket, configure_logging, serve

    configure_logging(args.log_level)
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    api_key = load_api_key(args.api_key_file)
    config = resolve_draft_model(engine_config_from_args(args))
    sock = bind_socket(args.host, args.port)  # before the model: a taken port fails at once
    model_dir = resolve_model(args.model)
    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
    )
    limits = ConnectionLimits(
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
    )
    return serve(
        model_dir,
        config,
        settings,
        sock,
        max_queue=args.max_queue,
        limits=limits,
        drain_timeout=args.drain_timeout,
    )
