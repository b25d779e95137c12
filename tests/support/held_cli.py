"""`python held_cli.py HOLD_FILE <inflight arguments>`: the inflight CLI, but every engine step first waits
while HOLD_FILE exists (and touches HOLD_FILE.held meanwhile).

The SIGTERM tests run `inflight serve` in a subprocess; this lets them hold a request in flight for as
long as they need, whatever the machine's speed, instead of hoping it is still running.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from inflight.cli import main
from inflight.engine.engine import LLMEngine, RequestOutput


def hold_steps_while(hold: Path) -> None:
    held = hold.with_name(hold.name + ".held")
    step = LLMEngine.step

    def held_step(self: LLMEngine) -> list[RequestOutput]:
        if hold.exists():
            held.touch()
            while hold.exists():
                time.sleep(0.01)
            held.unlink()
        return step(self)

    LLMEngine.step = held_step  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_steps_while(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
