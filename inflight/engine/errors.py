"""Engine errors a caller must tell apart from a failed request (no torch: the server imports this)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (a tensor-parallel rank died or a collective timed out).

    Unlike an error in one step, retrying is pointless: the server fails every request and exits non-zero
    so that the process (the pod) is restarted."""


class GrammarError(ValueError):
    """A request's grammar (JSON schema, regex, choices) cannot be used: invalid, unsupported by the
    grammar library, or too large."""


class ConstraintFailure(str):
    """Why a sequence failed when its own constraint (a grammar) had no way on: a schema the grammar
    library cannot follow to the end. The request's to fix, not an engine fault; a plain `str` otherwise,
    so it travels wherever a failure message does."""
