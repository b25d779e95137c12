"""Every API call the operator and the router make (`resources.OPERATOR_ACCESS`,
`resources.ROUTER_ACCESS`), as RBAC rules: the chart and docs/reference/rbac.md are built from them.

The operator gets, lists, watches, creates and merge-patches; it never PUTs (`update`). Children carry
owner references and are garbage-collected with their ModelServer (the model cache's claim and Job with
the last ModelServer that shares them, or deleted by the operator when the last one changes its source,
revision or cache); the other deletion is an HPA or ScaledObject of an autoscaling actuator no longer in
use.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.operator.api.resources import OPERATOR_ACCESS, ROUTER_ACCESS, Access


@dataclass(frozen=True)
class Permission:
    api_group: str  # "" is the core group
    resource: str  # plural, or plural/subresource
    verbs: tuple[str, ...]
    why: str
    scope: str  # "watched namespaces", "cluster", "operator namespace" or "router namespace"


def permission(access: Access) -> Permission:
    """The RBAC rule that allows one entry of a component's API calls."""
    resource = access.resource.plural
    if access.subresource is not None:
        resource += f"/{access.subresource}"
    return Permission(access.resource.group, resource, access.verbs, access.why, access.scope)


PERMISSIONS: tuple[Permission, ...] = tuple(map(permission, OPERATOR_ACCESS))
ROUTER_PERMISSIONS: tuple[Permission, ...] = tuple(map(permission, ROUTER_ACCESS))


def rules(scope: str) -> list[dict[str, list[str]]]:
    """RBAC `rules` for one scope, in the shape of a (Cluster)Role."""
    return [
        {"apiGroups": [p.api_group], "resources": [p.resource], "verbs": list(p.verbs)}
        for p in (*PERMISSIONS, *ROUTER_PERMISSIONS)
        if p.scope == scope
    ]
