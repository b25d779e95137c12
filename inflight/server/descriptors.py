"""The process's open-file limit (`ulimit -n`) against `--max-connections`: every connection is a file
descriptor, and a process out of them cannot accept (new connections are reset, nothing is logged).

At start the soft limit is raised toward the hard limit, as far as the connections need; when even that
is too low, the connection cap is lowered to what fits and a WARNING says so (the cap then evicts idle
connections instead of the kernel refusing new ones).
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger("inflight.server")

# Descriptors the server needs beside its connections: the listening socket, model files, the engine's
# and tokenizer threads' pipes, stdio (a tiny-model server holds 16 at idle).
RESERVED_DESCRIPTORS = 64


def fit_connection_cap(max_connections: int) -> int:
    """The connection cap the open-file limit allows: `max_connections` once the soft limit is raised
    far enough (up to the hard limit), else less, with a WARNING."""
    needed = max_connections + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError) as error:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, raised, error)
        else:
            logger.info(
                "raised the open-file limit (ulimit -n) from %d to %d for --max-connections", soft, raised
            )
            soft = raised
    if soft >= needed:
        return max_connections
    cap = max(1, soft - RESERVED_DESCRIPTORS)
    logger.warning(
        "the open-file limit (ulimit -n) is %d (hard limit %s), below the %d that --max-connections %d needs "
        "(%d kept for the server itself): serving at most %d connections; raise the limit (ulimit -n %d, "
        "or the container's nofile limit) to allow %d",
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        needed,
        max_connections,
        RESERVED_DESCRIPTORS,
        cap,
        needed,
        max_connections,
    )
    return cap
