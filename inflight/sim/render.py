"""The demo's picture without a browser: two Gantt charts (static above continuous) and the figures."""

from __future__ import annotations

import textwrap
from pathlib import Path

from inflight.sim.comparison import DemoComparison
from inflight.sim.timeline import PolicyResult

SHORT_COLOR = "#4c78a8"
LONG_COLOR = "#e4572e"
PREFILL_ALPHA = 0.45
IDLE_COLOR = "#f1f1f1"


def render_png(comparison: DemoComparison, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    slots = comparison.slots
    lane_height = max(0.12, min(0.3, 3.0 / slots))
    chart_height = 0.9 + slots * lane_height
    fig, (ax_static, ax_cont, ax_text) = plt.subplots(
        3,
        1,
        figsize=(12, 2 * chart_height + 2.4),
        gridspec_kw={"height_ratios": [chart_height, chart_height, 1.9]},
    )
    x_max = max(comparison.static.makespan_s, comparison.continuous.makespan_s) * 1.02
    static_title = "Static batching: a batch holds its slots until its longest member ends"
    continuous_title = "Continuous batching: a finished request's slot is refilled next step"
    for ax, result, title in (
        (ax_static, comparison.static, static_title),
        (ax_cont, comparison.continuous, continuous_title),
    ):
        _draw_gantt(ax, result, x_max, f"{title}  ({result.makespan_s:.2f} s)")
    ax_cont.set_xlabel(f"seconds ({comparison.kind})")
    fig.legend(
        handles=[
            Patch(color=SHORT_COLOR, label="short request (decoding)"),
            Patch(color=LONG_COLOR, label="long request (decoding)"),
            Patch(color=SHORT_COLOR, alpha=PREFILL_ALPHA, label="admitted, before its first token"),
            Patch(color=IDLE_COLOR, label="idle slot"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.55 / fig.get_figheight()),
        ncol=4,
        fontsize=9,
        frameon=False,
    )
    _draw_figures(ax_text, comparison)
    fig.suptitle(
        "\n".join(textwrap.wrap(comparison.summary, 100)),
        fontsize=11,
        fontweight="bold",
        y=1 - 0.08 / fig.get_figheight(),
    )
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.06, right=0.98, top=1 - 1.05 / height, bottom=0.1 / height, hspace=0.38)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _draw_gantt(ax: object, result: PolicyResult, x_max: float, title: str) -> None:
    from matplotlib.axes import Axes

    assert isinstance(ax, Axes)
    ax.set_facecolor(IDLE_COLOR)
    ax.set_xlim(0, x_max)
    ax.set_ylim(result.slots - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_ylabel("slot")
    step = max(1, result.slots // 8)
    ax.set_yticks(range(0, result.slots, step), [str(slot + 1) for slot in range(0, result.slots, step)])
    for request in result.requests:
        color = LONG_COLOR if request.long else SHORT_COLOR
        for segment in request.segments:
            first = min(max(request.first_token_s, segment.start_s), segment.end_s)
            y = segment.slot - 0.42
            ax.broken_barh(
                [(segment.start_s, first - segment.start_s)],
                (y, 0.84),
                facecolor=color,
                alpha=PREFILL_ALPHA,
                edgecolor="white",
                linewidth=0.5,
            )
            ax.broken_barh(
                [(first, segment.end_s - first)], (y, 0.84), facecolor=color, edgecolor="white", linewidth=0.5
            )
    ax.axvline(result.makespan_s, color="#333333", linewidth=0.8, linestyle="--")
    ax.grid(axis="x", color="white", linewidth=0.8)
    ax.set_axisbelow(True)


def _draw_figures(ax: object, comparison: DemoComparison) -> None:
    from matplotlib.axes import Axes

    assert isinstance(ax, Axes)
    ax.axis("off")
    rows = [
        ("throughput (output tokens/s)", "throughput_tokens_per_s", "{:,.0f}"),
        ("time to finish all requests (s)", "makespan_s", "{:.2f}"),
        ("mean latency (s)", "mean_latency_s", "{:.2f}"),
        ("p95 latency (s)", "p95_latency_s", "{:.2f}"),
        ("mean time to first token (s)", "mean_ttft_s", "{:.2f}"),
        ("idle slot-time (slot-s, share)", "idle_slot_s", "{:.2f}"),
        ("engine steps", "steps", "{:d}"),
    ]
    cells = []
    for label, key, fmt in rows:
        static_value = fmt.format(getattr(comparison.static, key))
        cont_value = fmt.format(getattr(comparison.continuous, key))
        if key == "idle_slot_s":
            static_value += f" ({comparison.static.idle_slot_fraction:.0%})"
            cont_value += f" ({comparison.continuous.idle_slot_fraction:.0%})"
        cells.append([label, static_value, cont_value])
    table = ax.table(
        cellText=cells,
        colLabels=["", "static", "continuous"],
        colWidths=[0.3, 0.15, 0.15],
        loc="center left",
        cellLoc="right",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.15)
    cost = comparison.cost_model
    note = (
        f"{comparison.workload.num_requests} requests ({comparison.workload.num_long} long), "
        f"{comparison.workload.prompt_tokens} prompt + {comparison.workload.output_tokens} output tokens, "
        f"all arriving at t=0."
    )
    if cost is not None:
        note += (
            f"\nEach step costs {1000 * cost.fixed_s:.2f} ms + {1000 * cost.per_token_s:.3f} ms per token"
            f"\n({cost.source})."
        )
    ax.text(0.64, 0.5, note, transform=ax.transAxes, fontsize=9, va="center", wrap=True)
