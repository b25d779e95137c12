"""The chart's RBAC is exactly the operator's list of API calls (operator/api/rbac.py), no wildcards."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from inflight.operator.api.rbac import PERMISSIONS, rules

WATCHED = ("team-a", "team-b")
ALL_NAMESPACES: tuple[str, ...] = ()
WATCH_SOME = ("--set", "watchNamespaces={team-a,team-b}")
NO_LEADER_ELECTION = ("--set", "replicaCount=1", "--set", "leaderElection.enabled=false")
DANGEROUS_VERBS = {"*", "update", "deletecollection", "escalate", "bind", "impersonate"}
# The only deletions: an HPA or ScaledObject the operator made, once the ModelServer's actuator changes
# (owner references remove everything else with the ModelServer).
DELETABLE = {
    ("autoscaling", "horizontalpodautoscalers"),
    ("keda.sh", "scaledobjects"),
    ("", "persistentvolumeclaims"),  # a model cache's claim and Job that no ModelServer uses any more
    ("batch", "jobs"),
}


def rule_set(rule_list: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rule_list
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def named(objects: list[dict[str, Any]], kind: str) -> dict[tuple[str | None, str], dict[str, Any]]:
    return {
        (obj["metadata"].get("namespace"), obj["metadata"]["name"]): obj
        for obj in objects
        if obj["kind"] == kind
    }


@pytest.mark.parametrize(
    "values", [ALL_NAMESPACES, WATCH_SOME, NO_LEADER_ELECTION], ids=["all", "some", "no-lease"]
)
def test_no_wildcards_no_update_and_deletes_only_of_autoscalers_and_caches(
    helm: Any, values: tuple[str, ...]
) -> None:
    roles = [obj for obj in helm.render(*values) if obj["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["apiGroups"] and "*" not in rule["resources"], rule
            assert not DANGEROUS_VERBS & set(rule["verbs"]), rule
            if "delete" in rule["verbs"]:
                assert {(g, r) for g in rule["apiGroups"] for r in rule["resources"]} <= DELETABLE, rule
            assert "nonResourceURLs" not in rule, rule


def test_all_namespaces_gets_one_cluster_role_and_the_lease_role(helm: Any) -> None:
    objects = helm.render()
    (cluster_role,) = named(objects, "ClusterRole").values()
    assert rule_set(cluster_role["rules"]) == rule_set(rules("cluster") + rules("watched namespaces"))
    (lease_role,) = named(objects, "Role").values()
    assert lease_role["metadata"]["namespace"] == helm.namespace
    assert rule_set(lease_role["rules"]) == rule_set(rules("operator namespace"))


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_reads(helm: Any) -> None:
    objects = helm.render(*WATCH_SOME)
    (cluster_role,) = named(objects, "ClusterRole").values()
    assert rule_set(cluster_role["rules"]) == rule_set(rules("cluster"))
    roles = named(objects, "Role")
    for namespace in WATCHED:
        assert rule_set(roles[(namespace, "inflight")]["rules"]) == rule_set(rules("watched namespaces"))
    assert rule_set(roles[(helm.namespace, "inflight-leader-election")]["rules"]) == rule_set(
        rules("operator namespace")
    )
    assert len(roles) == len(WATCHED) + 1


def test_no_lease_role_without_leader_election(helm: Any) -> None:
    assert named(helm.render(*NO_LEADER_ELECTION), "Role") == {}


@pytest.mark.parametrize("values", [ALL_NAMESPACES, WATCH_SOME], ids=["all", "some"])
def test_every_role_is_bound_to_the_operator_service_account(helm: Any, values: tuple[str, ...]) -> None:
    objects = helm.render(*values)
    roles = {(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]) for obj in objects}
    bindings = [obj for obj in objects if obj["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    bound = set()
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "inflight", "namespace": helm.namespace}
        ]
        ref = binding["roleRef"]
        namespace = None if ref["kind"] == "ClusterRole" else binding["metadata"]["namespace"]
        assert (ref["kind"], namespace, ref["name"]) in roles
        bound.add((ref["kind"], namespace, ref["name"]))
    assert bound == {role for role in roles if role[0] in ("ClusterRole", "Role")}


def test_rbac_can_be_left_to_the_platform(helm: Any) -> None:
    kinds = {obj["kind"] for obj in helm.render("--set", "rbac.create=false")}
    assert kinds.isdisjoint({"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})


def test_rules_template_is_current(helm: Any) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/render_chart_rbac.py", "--check"],
        capture_output=True,
        text=True,
        cwd=helm.root,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_rbac_reference_lists_every_permission_with_its_verbs(helm: Any) -> None:
    page = (helm.root / "docs" / "reference" / "rbac.md").read_text()
    for permission in PERMISSIONS:
        group = permission.api_group or "core"
        row = f"| `{permission.resource}` | `{group}` | {', '.join(permission.verbs)} |"
        assert row in page, f"docs/reference/rbac.md lacks the RBAC row {row}: run `make docs-reference`"


def test_docs_reference_is_current(helm: Any) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/render_docs_reference.py", "--check"],
        capture_output=True,
        text=True,
        cwd=helm.root,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
