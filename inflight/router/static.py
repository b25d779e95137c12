"""Static upstreams (`--upstream MODEL=URL`, repeatable): routing without Kubernetes."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from inflight.router.app import Discovery, Router
from inflight.router.pool import ModelPool


def parse_upstreams(specs: Iterable[str]) -> dict[str, list[str]]:
    """`MODEL=URL` strings -> model -> base URLs (in the order given, duplicates dropped)."""
    models: dict[str, list[str]] = {}
    for spec in specs:
        model, sep, url = spec.partition("=")
        model, url = model.strip(), url.strip().rstrip("/")
        parts = urlsplit(url)
        if not sep or not model or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"--upstream {spec!r}: expected MODEL=URL with an http(s) URL, "
                "e.g. --upstream tiny=http://127.0.0.1:8000"
            )
        urls = models.setdefault(model, [])
        if url not in urls:
            urls.append(url)
    return models


def static_discovery(upstreams: dict[str, list[str]], hold_timeout_s: float) -> Discovery:
    """A discovery coroutine function that installs the fixed pools once."""

    async def discover(router: Router) -> None:
        for model, urls in upstreams.items():
            pool = ModelPool(model, hold_timeout_s=hold_timeout_s)
            pool.set_replicas({url: url for url in urls})
            router.pools[model] = pool
        router.ready.set()

    return discover
