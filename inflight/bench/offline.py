"""`inflight bench offline`: the fixed workload through each system in one process, back to back.

tokens/s = generated tokens / wall time of the timed region (all requests submitted at once, until the
last finishes). Model load and a short warm-up request are done first and not counted. Every system
must generate exactly the requested number of tokens for every request, or its result is marked invalid.
With several rounds the systems alternate (the order reversed every other round, so that no system always
runs after the same one) and each system's median round is reported, with every round's tokens/s and the
ratios of the runs of the same round: a machine whose speed drifts by the minute moves those less than a
single pair.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench import hf_continuous, hf_naive, hf_static, inflight_engine, vllm_cpu
from inflight.bench.system import BenchSettings, System, SystemRun
from inflight.engine.cpu.isa import cpu_isa

SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        hf_naive.SYSTEM,
        hf_static.SYSTEM,
        hf_continuous.SYSTEM,
        vllm_cpu.SYSTEM,
        inflight_engine.STATIC,
        inflight_engine.CONTINUOUS,
    )
}
OURS = "inflight-continuous"
# Token-for-token agreement is reported against this system's greedy outputs when it ran.
REFERENCE = "hf-naive"


@dataclass
class SystemResult:
    name: str
    description: str
    status: str  # "ok", "skipped", "failed" or "invalid" (wrong output lengths)
    message: str = ""
    generated_tokens: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0
    tokens_per_s: float = 0.0
    # Requests whose tokens equal the reference system's (greedy), when both ran.
    identical_to_reference: int | None = None
    # The machine's 1-minute load average when the system started (others' work skews shared-CPU figures).
    load_average: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    # tokens/s of every round, in order (the result is the median round's); one entry for one round.
    rounds_tokens_per_s: list[float] = field(default_factory=list)


@dataclass
class OfflineReport:
    workload: dict[str, Any]
    environment: dict[str, Any]
    results: list[SystemResult]
    # "A/B": tokens/s of A divided by tokens/s of B, for our continuous engine against every other system
    # (with several rounds, the median of the rounds' ratios).
    ratios: dict[str, float]
    # The same ratios round by round (runs of the same round; a system is "ok" only if every round was).
    round_ratios: dict[str, list[float]] = field(default_factory=dict)


def check_lengths(run: SystemRun, settings: BenchSettings) -> str:
    """'' when every request got exactly its output length, else what was wrong."""
    if len(run.outputs) != len(settings.requests):
        return f"returned {len(run.outputs)} outputs for {len(settings.requests)} requests"
    wrong = [
        (i, len(out), req.output_len)
        for i, (out, req) in enumerate(zip(run.outputs, settings.requests, strict=True))
        if len(out) != req.output_len
    ]
    if wrong:
        i, got, want = wrong[0]
        return f"{len(wrong)} requests got the wrong number of tokens (request {i}: {got}, wanted {want})"
    return ""


def run_system(system: System, settings: BenchSettings, say: Any) -> tuple[SystemResult, SystemRun | None]:
    reason = system.unavailable(settings)
    if reason is None and not system.takes_schemas and any(r.schema for r in settings.requests):
        reason = "it does not constrain output with a JSON schema here (--schema-share)"
    if reason:
        say(f"[{system.name}] skipped: {reason}")
        return SystemResult(system.name, system.description, "skipped", reason), None
    load = os.getloadavg()[0]
    say(f"[{system.name}] running: {system.description} (load average {load:.1f})")
    try:
        run = system.run(settings)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        say(f"[{system.name}] failed: {error}")
        return SystemResult(system.name, system.description, "failed", str(error)), None
    finally:
        gc.collect()
    problem = check_lengths(run, settings)
    generated = sum(len(out) for out in run.outputs)
    result = SystemResult(
        name=system.name,
        description=system.description,
        status="invalid" if problem else "ok",
        message=problem,
        generated_tokens=generated,
        seconds=run.seconds,
        setup_seconds=run.setup_seconds,
        tokens_per_s=generated / run.seconds if run.seconds > 0 else 0.0,
        load_average=load,
        config=run.config,
    )
    say(
        f"[{system.name}] {generated} tokens in {run.seconds:.1f} s = {result.tokens_per_s:.1f} tokens/s "
        f"(setup {run.setup_seconds:.1f} s, not counted){'; INVALID: ' + problem if problem else ''}"
    )
    return result, run


def run_offline(names: list[str], settings: BenchSettings, say: Any, rounds: int = 1) -> OfflineReport:
    import torch

    if settings.threads:
        torch.set_num_threads(settings.threads)
    per_round: dict[str, list[SystemResult]] = {name: [] for name in names}
    runs: dict[str, SystemRun] = {}  # each system's first good run: its outputs are compared
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        if rounds > 1:
            say(f"round {round_index + 1}/{rounds}: {', '.join(order)}")
        for name in order:
            earlier = per_round[name]
            if earlier and earlier[-1].status != "ok":
                continue  # skipped, failed or invalid: once is enough
            result, run = run_system(SYSTEMS[name], settings, say)
            earlier.append(result)
            if run is not None and result.status == "ok":
                runs.setdefault(name, run)
    results = [_median_round(per_round[name]) for name in names]
    reference = runs[REFERENCE].outputs if REFERENCE in runs else None
    if reference is not None:
        for result in results:
            if result.name in runs:
                outputs = runs[result.name].outputs
                result.identical_to_reference = sum(a == b for a, b in zip(outputs, reference, strict=True))
    ok = {r.name: r for r in results if r.status == "ok" and r.tokens_per_s > 0}
    round_ratios = {
        f"{OURS}/{name}": [
            ours / other
            for ours, other in zip(ok[OURS].rounds_tokens_per_s, result.rounds_tokens_per_s, strict=True)
        ]
        for name, result in ok.items()
        if OURS in ok and name != OURS
    }
    # Runs of the same round are the closest in time: the ratio is the median of the rounds' ratios.
    ratios = {pair: statistics.median(values) for pair, values in round_ratios.items()}
    requests = settings.requests
    workload = {
        "model_dir": str(settings.model_dir),
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "prompt_len_range": [
            min(len(r.prompt_token_ids) for r in requests),
            max(len(r.prompt_token_ids) for r in requests),
        ],
        "output_len_range": [min(r.output_len for r in requests), max(r.output_len for r in requests)],
        "requests_with_schema": sum(r.schema is not None for r in requests),
        "dtype": settings.dtype,
        "max_slots": settings.max_slots,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "sampling": "greedy, ignore_eos, exact output lengths",
        "rounds": rounds,
    }
    environment = {
        "cpus": os.cpu_count(),
        "cpu": cpu_isa().describe(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return OfflineReport(workload, environment, results, ratios, round_ratios)


def _median_round(results: list[SystemResult]) -> SystemResult:
    """One system's rounds as one result: the median round's (the lower middle one of an even count), with
    every round's tokens/s; a system that did not run cleanly every round is its last result."""
    if any(r.status != "ok" for r in results):
        return results[-1]
    speeds = [r.tokens_per_s for r in results]
    median = next(r for r in results if r.tokens_per_s == statistics.median_low(speeds))
    median.rounds_tokens_per_s = speeds
    return median


def format_table(report: OfflineReport) -> str:
    header = (
        f"{'system':<22}{'tokens/s':>10}{'time s':>9}{'setup s':>9}{'tokens':>8}{'same as hf':>12}{'load':>6}"
        f"  {OURS} is"
    )
    lines = [header, "-" * len(header)]
    for r in report.results:
        if r.status != "ok":
            lines.append(f"{r.name:<22}{r.status:>10}  {r.message}")
            continue
        total = report.workload["num_requests"]
        same = "" if r.identical_to_reference is None else f"{r.identical_to_reference}/{total}"
        ratio = report.ratios.get(f"{OURS}/{r.name}")
        ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
        lines.append(
            f"{r.name:<22}{r.tokens_per_s:>10.1f}{r.seconds:>9.1f}{r.setup_seconds:>9.1f}"
            f"{r.generated_tokens:>8}{same:>12}{r.load_average:>6.1f}  {ratio_text}"
        )
    for r in report.results:
        if len(r.rounds_tokens_per_s) > 1:
            speeds = ", ".join(f"{v:.1f}" for v in r.rounds_tokens_per_s)
            lines.append(f"{r.name} by round: {speeds} tokens/s (the median round above)")
    for r in report.results:
        if r.status == "ok" and "rss_mib_after_load" in r.config:
            lines.append(
                f"{r.name}: {r.config['quantization']} weights from {r.config['model']}, "
                f"{r.config['num_kv_blocks']} KV blocks, "
                f"process RSS after load {r.config['rss_mib_after_load']} MiB"
            )
    for pair, values in report.round_ratios.items():
        if len(values) > 1:
            lines.append(f"{pair} by round: {', '.join(f'{v:.2f}x' for v in values)}")
    lines.append(f"{report.workload['dtype']} on {report.environment.get('cpu', 'an unknown CPU')}")
    return "\n".join(lines)


def write_outputs(report: OfflineReport, out_dir: Path) -> list[Path]:
    """offline.json (everything), offline.txt (the table) and offline.png (a bar chart)."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "offline.json"
    json_path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    table_path = out_dir / "offline.txt"
    table_path.write_text(format_table(report) + "\n")
    png_path = out_dir / "offline.png"
    plot(report, png_path)
    return [json_path, table_path, png_path]


def plot(report: OfflineReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in report.results if r.status == "ok"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * max(len(ran), 1) + 1.5))
    names = [r.name for r in ran]
    values = [r.tokens_per_s for r in ran]
    colors = ["tab:orange" if r.name.startswith("inflight") else "tab:gray" for r in ran]
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    for y, r in enumerate(ran):
        label = f"{r.tokens_per_s:.0f}"
        ratio = report.ratios.get(f"{OURS}/{r.name}")
        if ratio is not None:
            label += f"  ({OURS} {ratio:.2f}x)"
        ax.text(r.tokens_per_s, y, " " + label, va="center", fontsize=9)
    ax.set_xlabel("generated tokens/s (higher is better)")
    w = report.workload
    ax.set_title(
        f"Offline throughput: {w['num_requests']} requests, {w['output_tokens']} output tokens, {w['dtype']}",
        fontsize=10,
    )
    ax.set_xlim(0, max(values, default=1) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
