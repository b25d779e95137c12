"""`inflight router`: the OpenAI-compatible router. Heavy imports happen in the handler."""

from __future__ import annotations

import argparse

from inflight.cli.args import add_listen_args, add_log_level_arg
from inflight.router.routing_key import DEFAULT_KEY_CHARS


def register(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser(
        "router",
        help="one OpenAI-compatible endpoint for many models: routes by model and prompt prefix",
        description="Forward OpenAI API requests to the replicas serving the request's `model`: the "
        "ready pods of the namespace's ModelServers (watched through the Kubernetes API), or the "
        "--upstream servers. A prompt's start goes to the same replica while it has room (its prefix "
        "cache holds it): consistent hashing with bounded loads. See docs/router.md.",
    )
    router.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="MODEL=URL",
        help="a server of MODEL at URL (repeatable, several per model); without it the router watches "
        "the ModelServers of --namespace",
    )
    router.add_argument(
        "--namespace",
        help="namespace whose ModelServers are routed (default: $POD_NAMESPACE, the pod's own, or default)",
    )
    add_listen_args(router, default_port=8080)
    router.add_argument(
        "--policy",
        choices=("prefix", "round-robin"),
        default="prefix",
        help="prefix: consistent hashing of the prompt's start with bounded loads; round-robin: the "
        "baseline a plain Service gives (default: prefix)",
    )
    router.add_argument(
        "--epsilon",
        type=float,
        default=0.25,
        help="load bound: no replica takes more than ceil((1+e) x mean in-flight) (default: 0.25)",
    )
    router.add_argument(
        "--key-chars",
        type=int,
        default=DEFAULT_KEY_CHARS,
        help=f"characters of the prompt's start that pick the replica (default: {DEFAULT_KEY_CHARS})",
    )
    router.add_argument(
        "--max-held",
        type=int,
        default=256,
        help="requests per model that may wait for a replica to become ready; more get 503 (default: 256)",
    )
    router.add_argument(
        "--hold-timeout",
        type=float,
        default=60.0,
        help="seconds a request waits for a ready replica when its ModelServer does not set "
        "autoscaling.scaleFromZeroTimeoutSeconds (default: 60)",
    )
    router.add_argument(
        "--scrape-interval",
        type=float,
        default=2.0,
        help="seconds between reads of every replica's /metrics (default: 2)",
    )
    add_log_level_arg(router)
    router.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from inflight.router.app import Router, RouterApp, RouterSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not 0 <= args.epsilon <= 10:
        raise SystemExit("--epsilon must be between 0 and 10")
    if args.key_chars < 1 or args.max_held < 0 or args.hold_timeout <= 0 or args.scrape_interval <= 0:
        raise SystemExit("--key-chars and --hold-timeout and --scrape-interval must be > 0, --max-held >= 0")
    settings = RouterSettings(
        prefix_affinity=args.policy == "prefix",
        epsilon=args.epsilon,
        key_chars=args.key_chars,
        max_held=args.max_held,
        scrape_interval_s=args.scrape_interval,
    )
    if args.upstream:
        from inflight.router.static import parse_upstreams, static_discovery

        try:
            upstreams = parse_upstreams(args.upstream)
        except ValueError as error:
            raise SystemExit(str(error)) from error
        discovery = static_discovery(upstreams, args.hold_timeout)
    else:
        from inflight.operator.main import operator_namespace
        from inflight.router.kubernetes import kubernetes_discovery

        discovery = kubernetes_discovery(operator_namespace(args.namespace), args.hold_timeout)
    app = RouterApp(Router(settings), discovery)
    # proxy_headers off: the router reads no client address, so the middleware would only cost time
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        proxy_headers=False,
    )
    return 0
