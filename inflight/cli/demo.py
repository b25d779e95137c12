"""`inflight demo`: the static-vs-continuous page on a live server, or its picture as a PNG.

Heavy imports (torch, FastAPI, matplotlib) happen inside the handler.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.checkpoints.resolve import resolve_draft_model, resolve_model
from inflight.cli.args import add_listen_args, add_log_level_arg, add_model_arg
from inflight.engine.cli_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from inflight.sim.cost_model import CostModel

DEFAULT_SLOTS = 8
DRAIN_TIMEOUT_S = 5.0
COST_MODEL_FILE = "demo-cost-model.json"


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="static vs continuous batching on the same 30 requests: a page with a slot slider",
        description="Start the server with the demo page (GET /demo) and print its URL. The page shows the "
        "engine's real StaticScheduler and ContinuousScheduler on the same 30 requests, simulated on a "
        "virtual clock for 1..32 slots, and runs them for real on the loaded model at a click. "
        "--png writes the same picture without a browser and exits.",
    )
    add_model_arg(demo, default="builtin:smollm2")
    add_engine_args(demo)
    add_listen_args(demo, default_port=8000)
    demo.add_argument(
        "--calibrate",
        action="store_true",
        help="first time the real engine's steps on the model and fit the simulator's cost model "
        f"(seconds per step = fixed + per token); saved as $INFLIGHT_CACHE_DIR/{COST_MODEL_FILE} and used "
        "from then on",
    )
    demo.add_argument("--png", type=Path, metavar="OUT", help="write the picture to OUT (.png) and exit")
    demo.add_argument(
        "--slots",
        type=int,
        default=DEFAULT_SLOTS,
        help=f"slots for --png, and for the timed runs of --calibrate (default: {DEFAULT_SLOTS})",
    )
    add_log_level_arg(demo)
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from inflight.cache import cache_dir
    from inflight.sim.cost_model import DEFAULT_COST_MODEL, load_cost_model
    from inflight.sim.simulator import validate_slots

    try:
        validate_slots(args.slots)
    except ValueError as error:
        raise SystemExit(f"--slots: {error}") from error
    cost_path = cache_dir() / COST_MODEL_FILE
    if args.calibrate:
        cost_model = _calibrate(args, cost_path)
    else:
        cost_model = load_cost_model(cost_path) or DEFAULT_COST_MODEL
    print(f"inflight demo: step cost model: {cost_model.source}", flush=True)
    if args.png is not None:
        return _write_png(args.png, args.slots, cost_model)
    return _serve_demo(args, cost_model)


def _calibrate(args: argparse.Namespace, cost_path: Path) -> CostModel:
    import time

    from inflight.sim.cost_model import fit_cost_model, save_cost_model
    from inflight.sim.live import run_live
    from inflight.sim.simulator import simulate

    model_dir = resolve_model(args.model)
    base_config = resolve_draft_model(engine_config_from_args(args))
    started = time.perf_counter()
    comparison, samples = run_live(
        model_dir,
        args.slots,
        base_config,
        progress=lambda message: print(f"inflight demo --calibrate: {message}", flush=True),
    )
    stamp = time.strftime("%Y-%m-%d %H:%M")
    cost_model = fit_cost_model(
        samples, source=f"calibrated on {model_dir.name} ({len(samples)} timed steps, {stamp})"
    )
    save_cost_model(cost_model, cost_path)
    simulated = simulate(args.slots, cost_model)
    print(
        f"inflight demo --calibrate: {len(samples)} steps in {time.perf_counter() - started:.0f} s; "
        f"fit: {1000 * cost_model.fixed_s:.2f} ms per step + "
        f"{1000 * cost_model.per_token_s:.3f} ms per token; "
        f"saved to {cost_path}\n"
        f"  measured:  {comparison.summary}\n  simulated: {simulated.summary}",
        flush=True,
    )
    return cost_model


def _write_png(out: Path, slots: int, cost_model: CostModel) -> int:
    from inflight.sim.render import render_png
    from inflight.sim.simulator import simulate

    comparison = simulate(slots, cost_model)
    render_png(comparison, out)
    print(f"inflight demo: wrote {out}\n  {comparison.summary}", flush=True)
    return 0


def _serve_demo(args: argparse.Namespace, cost_model: CostModel) -> int:
    from inflight.server.context import ServerSettings
    from inflight.server.run import bind_socket, configure_logging, serve

    configure_logging(args.log_level)
    config = resolve_draft_model(engine_config_from_args(args))
    sock = bind_socket(args.host, args.port)  # before the model: a taken port fails at once
    model_dir = resolve_model(args.model)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"\n  inflight demo: open http://{host}:{args.port}/demo\n"
        f"  (model {model_dir}; the OpenAI API is at http://{host}:{args.port}/v1; Ctrl-C stops)\n",
        flush=True,
    )
    return serve(
        model_dir,
        config,
        ServerSettings(served_model_name=args.model),
        sock,
        drain_timeout=DRAIN_TIMEOUT_S,
        app_state={"demo_cost_model": cost_model},
    )
