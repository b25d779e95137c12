"""The chart's `inflight router` per namespace (router.namespaces): objects, RBAC, restricted pods."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from inflight.operator.api.rbac import ROUTER_PERMISSIONS, rules

VALUES = ("--set", "router.namespaces={team-a,team-b}", "--set-json", "router.epsilon=0.5")


def router_objects(helm: Any) -> list[dict[str, Any]]:
    return [
        obj
        for obj in helm.render(*VALUES)
        if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"
    ]


def test_no_router_by_default(helm: Any) -> None:
    assert not [obj for obj in helm.render() if "router" in obj["metadata"]["name"]]


def test_each_namespace_gets_a_router_with_service_and_role(helm: Any) -> None:
    objects = router_objects(helm)
    for namespace in ("team-a", "team-b"):
        mine = {obj["kind"]: obj for obj in objects if obj["metadata"]["namespace"] == namespace}
        assert sorted(mine) == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
        assert mine["Role"]["rules"] == rules("router namespace")
        assert mine["RoleBinding"]["subjects"] == [
            {"kind": "ServiceAccount", "name": "inflight-router", "namespace": namespace}
        ]
        pod = mine["Deployment"]["spec"]["template"]
        assert mine["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["inflight", "router"]
        assert f"--namespace={namespace}" in container["args"] and "--epsilon=0.5" in container["args"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for obj in mine.values():
            kubernetes_validate.validate(obj, helm.kube_version, strict=True)


def test_router_permissions_are_reads_and_the_wake_patch() -> None:
    verbs = {p.resource: set(p.verbs) for p in ROUTER_PERMISSIONS}
    assert verbs == {"modelservers": {"get", "list", "watch", "patch"}, "pods": {"get", "list", "watch"}}
