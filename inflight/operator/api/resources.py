"""Every Kubernetes resource the operator and the router use, defined once, with the verbs each of them
uses on it (`OPERATOR_ACCESS`, `ROUTER_ACCESS`): the chart's RBAC rules (`rbac.py`) are derived from these
lists, and `kube.KubeClient` calls are made on these resources' paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.operator.api import types


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/api/{self.version}" if self.group == "" else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
        if subresource is not None:
            base += f"/{subresource}"
        return base


MODELSERVERS = Resource(types.GROUP, types.VERSION, types.PLURAL)
DEPLOYMENTS = Resource("apps", "v1", "deployments")
SERVICES = Resource("", "v1", "services")
SECRETS = Resource("", "v1", "secrets")
PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes", namespaced=False)
EVENTS = Resource("", "v1", "events")
HORIZONTAL_POD_AUTOSCALERS = Resource("autoscaling", "v2", "horizontalpodautoscalers")
SCALED_OBJECTS = Resource("keda.sh", "v1alpha1", "scaledobjects")
PERSISTENT_VOLUME_CLAIMS = Resource("", "v1", "persistentvolumeclaims")
JOBS = Resource("batch", "v1", "jobs")
LEASES = Resource("coordination.k8s.io", "v1", "leases")

WATCHED_NAMESPACES = "watched namespaces"
CLUSTER = "cluster"
OPERATOR_NAMESPACE = "operator namespace"
ROUTER_NAMESPACE = "router namespace"


@dataclass(frozen=True)
class Access:
    """The verbs a component uses on a resource (or one of its subresources), where, and why.

    The chart's RBAC rules are derived from these lists (`inflight.operator.api.rbac`): a call that is
    not here is forbidden in a cluster.
    """

    resource: Resource
    verbs: tuple[str, ...]
    why: str
    scope: str = WATCHED_NAMESPACES  # or CLUSTER, OPERATOR_NAMESPACE, ROUTER_NAMESPACE
    subresource: str | None = None


OPERATOR_ACCESS: tuple[Access, ...] = (
    Access(MODELSERVERS, ("get", "list", "watch"), "read ModelServers; kopf watches them"),
    Access(MODELSERVERS, ("patch",), "write status (merge patch)", subresource="status"),
    Access(
        DEPLOYMENTS,
        ("get", "list", "watch", "create", "patch"),
        "create the server Deployment, repair drift, roll out spec changes; watch to react at once",
    ),
    Access(SERVICES, ("get", "list", "watch", "create", "patch"), "create and repair the server Service"),
    Access(
        SECRETS,
        ("get",),
        "check that the API-key and HF-token Secrets exist (values are never read out)",
    ),
    Access(
        PERSISTENT_VOLUME_CLAIMS,
        ("get", "list", "create", "patch", "delete"),
        "create the model cache's claim (model.cache.pvc), check an existing one (model.cache.claimName); "
        "patch: add or drop a ModelServer that shares it; delete it when its last ModelServer moved on",
    ),
    Access(
        JOBS,
        ("get", "list", "watch", "create", "patch", "delete"),
        "create the one download Job per model source and revision; watch it to start the Deployment when "
        "it succeeds; patch: add or drop a ModelServer that shares it; delete it when its last ModelServer "
        "moved on",
    ),
    Access(PODS, ("get",), "read the download Job's progress lines for status.modelCache", subresource="log"),
    Access(NODES, ("list",), "read GPU feature discovery labels for sizing", scope=CLUSTER),
    Access(
        PODS,
        ("list", "watch"),
        "read the ready server pods' /metrics (measured sizing, builtin autoscaling); find the download "
        "Job's pods; watch the server pods so readiness and SizingDrift follow within seconds",
    ),
    Access(
        HORIZONTAL_POD_AUTOSCALERS,
        ("get", "list", "watch", "create", "patch", "delete"),
        "create and repair (watch) the HPA of actuator hpa; delete it when the actuator changes",
    ),
    Access(
        SCALED_OBJECTS,
        ("get", "create", "patch", "delete"),
        "create and repair the KEDA ScaledObject of actuator keda; delete it when the actuator changes",
    ),
    Access(EVENTS, ("create",), "Events for sizing decisions and failures (posted by kopf)"),
    Access(
        LEASES,
        ("get", "create", "patch"),
        "leader election on the Lease inflight-operator",
        scope=OPERATOR_NAMESPACE,
    ),
)
"""Every API call the operator makes."""

ROUTER_ACCESS: tuple[Access, ...] = (
    Access(
        MODELSERVERS,
        ("get", "list", "watch", "patch"),
        "route by served model name; patch sets the wake annotation (scale from zero)",
        scope=ROUTER_NAMESPACE,
    ),
    Access(PODS, ("get", "list", "watch"), "the ready server pods are the replicas", scope=ROUTER_NAMESPACE),
)
"""Every API call `inflight router` makes (in the namespace it routes)."""
