"""A live demo server for the sim endpoint tests (the `demo_server` fixture in tests/sim/conftest.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


@dataclass
class DemoServer:
    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
