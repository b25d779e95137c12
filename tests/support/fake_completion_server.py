"""A stand-in for a server `inflight bench serve` starts: `python fake_completion_server.py NAME PORT DIR`.

It answers GET (a readiness probe) with 200 and a streaming POST /v1/completions with `max_tokens`
one-token chunks and a usage chunk, as an OpenAI server does. Starting only the standard library, it is
ready in a fraction of a second. For the tests that check which servers are alive together, it keeps
its pid in DIR/alive/ while it runs and appends to DIR/log one line per event: `NAME start PID`, and
`NAME request OTHERS`, OTHERS the number of other servers alive at that request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path


def others_alive(alive: Path) -> int:
    count = 0
    for entry in alive.iterdir():
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        count += 1
    return count


def log(folder: Path, line: str) -> None:
    with (folder / "log").open("a") as file:
        file.write(line + "\n")


async def main(name: str, port: int, folder: Path) -> None:
    alive = folder / "alive"
    alive.mkdir(exist_ok=True)
    (alive / str(os.getpid())).touch()
    log(folder, f"{name} start {os.getpid()}")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = (await reader.readline()).split(b" ")[0]
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            if key.lower() == "content-length":
                length = int(value)
        if method != b"POST":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        else:
            tokens = json.loads(await reader.readexactly(length))["max_tokens"]
            log(folder, f"{name} request {others_alive(alive)}")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            usage = {"completion_tokens": tokens, "prompt_tokens": 1, "total_tokens": tokens + 1}
            events = [{"choices": [{"text": "a", "index": 0}]}] * tokens + [{"choices": [], "usage": usage}]
            for event in [*(json.dumps(e, separators=(",", ":")) for e in events), "[DONE]"]:
                data = f"data: {event}\n\n".encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    async with await asyncio.start_server(handle, "127.0.0.1", port):
        await stopped.wait()
    (alive / str(os.getpid())).unlink()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])))
