"""Every API call the operator makes, as RBAC rules: the chart and docs/reference/rbac.md are built from it.

The operator gets, lists, watches, creates and merge-patches; it never PUTs (`update`). Children carry
owner references and are garbage-collected with their ModelServer (the model cache's claim and Job with
the last ModelServer that shares them, or deleted by the operator when the last one changes its source,
revision or cache); the other deletion is an HPA or ScaledObject of an autoscaling actuator no longer in
use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Permission:
    api_group: str  # "" is the core group
    resource: str
    verbs: tuple[str, ...]
    why: str
    scope: str = "watched namespaces"  # or "cluster" or "operator namespace"


PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        "inflight.dev", "modelservers", ("get", "list", "watch"), "read ModelServers; kopf watches them"
    ),
    Permission("inflight.dev", "modelservers/status", ("patch",), "write status (merge patch)"),
    Permission(
        "apps",
        "deployments",
        ("get", "list", "watch", "create", "patch"),
        "create the server Deployment, repair drift, roll out spec changes; watch to react at once",
    ),
    Permission(
        "", "services", ("get", "list", "watch", "create", "patch"), "create and repair the server Service"
    ),
    Permission(
        "",
        "secrets",
        ("get",),
        "check that the API-key and HF-token Secrets exist (values are never read out)",
    ),
    Permission(
        "",
        "persistentvolumeclaims",
        ("get", "list", "create", "patch", "delete"),
        "create the model cache's claim (model.cache.pvc), check an existing one (model.cache.claimName); "
        "patch: add or drop a ModelServer that shares it; delete it when its last ModelServer moved on",
    ),
    Permission(
        "batch",
        "jobs",
        ("get", "list", "watch", "create", "patch", "delete"),
        "create the one download Job per model source and revision; watch it to start the Deployment when "
        "it succeeds; patch: add or drop a ModelServer that shares it; delete it when its last ModelServer "
        "moved on",
    ),
    Permission("", "pods/log", ("get",), "read the download Job's progress lines for status.modelCache"),
    Permission("", "nodes", ("list",), "read GPU feature discovery labels for sizing", scope="cluster"),
    Permission(
        "",
        "pods",
        ("list",),
        "read the ready server pods' /metrics (measured sizing, builtin autoscaling); find the download "
        "Job's pods",
    ),
    Permission(
        "autoscaling",
        "horizontalpodautoscalers",
        ("get", "list", "watch", "create", "patch", "delete"),
        "create and repair (watch) the HPA of actuator hpa; delete it when the actuator changes",
    ),
    Permission(
        "keda.sh",
        "scaledobjects",
        ("get", "create", "patch", "delete"),
        "create and repair the KEDA ScaledObject of actuator keda; delete it when the actuator changes",
    ),
    Permission("", "events", ("create",), "Events for sizing decisions and failures (posted by kopf)"),
    Permission(
        "coordination.k8s.io",
        "leases",
        ("get", "create", "patch"),
        "leader election on the Lease inflight-operator",
        scope="operator namespace",
    ),
)


ROUTER_PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        "inflight.dev",
        "modelservers",
        ("get", "list", "watch", "patch"),
        "route by served model name; patch sets the wake annotation (scale from zero)",
        scope="router namespace",
    ),
    Permission(
        "",
        "pods",
        ("get", "list", "watch"),
        "the ready server pods are the replicas",
        scope="router namespace",
    ),
)
"""Every API call `inflight router` makes (in the namespace it routes)."""


def rules(scope: str) -> list[dict[str, list[str]]]:
    """RBAC `rules` for one scope, in the shape of a (Cluster)Role."""
    return [
        {"apiGroups": [p.api_group], "resources": [p.resource], "verbs": list(p.verbs)}
        for p in (*PERMISSIONS, *ROUTER_PERMISSIONS)
        if p.scope == scope
    ]
