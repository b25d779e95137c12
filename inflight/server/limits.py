"""Transport limits of `inflight serve` (the numbers, light to import; transport.py enforces them).

- A body over `max_body_bytes` gets 413 (from Content-Length before reading it, or once a chunked body
  passes the limit), so one request cannot make the server parse and tokenize hundreds of megabytes.
- At most `max_connections` connections are open: a new one beyond that evicts the oldest connection
  that has no request being answered (idle keep-alive, or still sending its headers), else is closed.
  Half-sent requests therefore cannot exhaust file descriptors, and /health keeps answering.
- A connection has `header_timeout` seconds to send a request's headers and `body_timeout` seconds
  (from the end of the headers) to send its body; then it gets 408 and is closed.

The defaults are here once; `inflight serve` flags override them (see docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# Sequences that may wait for a slot beyond the engine's; more get 429.
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
