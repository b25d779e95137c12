"""`inflight operator`: the ModelServer operator (kopf loads in the handler)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    operator = commands.add_parser(
        "operator",
        help="run the ModelServer operator against the cluster (pod service account, else KUBECONFIG)",
        description="Reconcile ModelServers into sized Deployments and Services. Credentials: the pod's "
        "service account in a cluster, else KUBECONFIG / ~/.kube/config (token or client-certificate "
        "users). Replicas elect a leader on the Lease inflight-operator.",
    )
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=None, help="watch only this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces (default)")
    operator.add_argument(
        "--no-leader-election", action="store_true", help="skip the Lease: only for a single local replica"
    )
    operator.add_argument(
        "--lease-namespace", default=None, help="namespace of the Lease (default: the pod's own namespace)"
    )
    operator.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint for the pod's probe; empty: none",
    )
    operator.add_argument(
        "--resync-seconds", type=float, default=60.0, help="re-check every ModelServer this often"
    )
    operator.add_argument(
        "--autoscale-seconds",
        type=float,
        default=15.0,
        help="builtin autoscaling: scrape the pods' /metrics and decide this often",
    )
    operator.add_argument(
        "--scrape-timeout-seconds",
        type=float,
        default=2.0,
        help="builtin autoscaling: a pod slower than this to answer /metrics counts as unknown",
    )
    operator.add_argument(
        "--metrics-address",
        default="0.0.0.0:8081",
        help="host:port serving the operator's own Prometheus /metrics; empty: none (default: 0.0.0.0:8081)",
    )
    operator.add_argument("--verbose", action="store_true", help="debug logging")
    operator.set_defaults(func=_run_operator)


def _run_operator(args: argparse.Namespace) -> int:
    from inflight.operator.main import OperatorOptions, run_operator

    options = OperatorOptions(
        namespaces=tuple(args.namespace or ()),
        leader_election=not args.no_leader_election,
        lease_namespace=args.lease_namespace,
        liveness=args.liveness or None,
        resync_seconds=args.resync_seconds,
        autoscale_seconds=args.autoscale_seconds,
        scrape_timeout_seconds=args.scrape_timeout_seconds,
        metrics_address=args.metrics_address or None,
        verbose=args.verbose,
    )
    return run_operator(options)
