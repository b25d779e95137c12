"""charts/inflight rendered by the real helm: lint, Kubernetes 1.32 schemas, restricted pods, values."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

VARIANTS = {
    "defaults": (),
    "no-leader-election": ("--set", "replicaCount=1", "--set", "leaderElection.enabled=false"),
    "existing-service-account": ("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops"),
    "pinned-digest": ("--set", "image.digest=sha256:" + "a" * 64, "--set", "imagePullSecrets={regcred}"),
    "watch-namespaces": ("--set", "watchNamespaces={team-a,team-b}", "--set", "verbose=true"),
    "router": ("--set", "router.namespaces={team-a,team-b}", "--set", "router.policy=round-robin"),
    "scheduling": (
        "--set",
        "nodeSelector.pool=system",
        "--set",
        "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
        "--set",
        "priorityClassName=system-cluster-critical",
        "--set",
        "podAnnotations.team=ml",
        "--set",
        "securityContext.runAsUser=null,securityContext.runAsGroup=null",
    ),
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def operator_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployments = [
        obj
        for obj in by_kind(objects, "Deployment")
        if obj["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    assert len(deployments) == 1
    return deployments[0]


def test_helm_lint_strict(helm: Any) -> None:
    result = helm.run("lint", "--strict", str(helm.chart), "--kube-version", helm.kube_version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_passes_the_kubernetes_schema(helm: Any, variant: str) -> None:
    with_crds = ("--include-crds",) if variant == "defaults" else ()  # the CRD is the same in every variant
    objects = helm.render(*with_crds, *VARIANTS[variant])
    assert objects
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, helm.kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{variant}: {name} at {list(error.path)}: {error.message}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_namespaced_objects_go_to_the_release_namespace(helm: Any, variant: str) -> None:
    values = VARIANTS[variant]
    watched = {"team-a", "team-b"} if variant in ("watch-namespaces", "router") else set()
    for obj in helm.render(*values):
        if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router":
            continue  # tests/install/test_router_chart.py
        if obj["kind"] in ("ServiceAccount", "Deployment", "PodDisruptionBudget"):
            assert obj["metadata"]["namespace"] == helm.namespace, obj["metadata"]
        if obj["kind"] in ("Role", "RoleBinding"):
            assert obj["metadata"]["namespace"] in {helm.namespace} | watched, obj["metadata"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pods_are_restricted(helm: Any, variant: str) -> None:
    pod = operator_deployment(helm.render(*VARIANTS[variant]))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert context.get("privileged") is not True
        assert context.get("runAsUser", 1) != 0
        assert container["resources"]["requests"]["memory"]
        assert container["resources"]["limits"]["memory"]
        assert container["livenessProbe"] and container["readinessProbe"]
    assert pod["securityContext"].get("runAsUser", 1) != 0


def test_default_operator_deployment(helm: Any) -> None:
    deployment = operator_deployment(helm.render())
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/inflight-dev/inflight-operator:0.1.0"
    assert container["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-address=0.0.0.0:8081",
        "--resync-seconds=60",
        "--autoscale-seconds=15",
        "--scrape-timeout-seconds=2",
    ]
    env = {item["name"]: item["valueFrom"]["fieldRef"]["fieldPath"] for item in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    assert pod["serviceAccountName"] == "inflight"
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_leader_election_can_be_turned_off(helm: Any) -> None:
    deployment = operator_deployment(helm.render(*VARIANTS["no-leader-election"]))
    assert deployment["spec"]["replicas"] == 1
    assert "--no-leader-election" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_watched_namespaces_become_operator_flags(helm: Any) -> None:
    (container,) = operator_deployment(helm.render(*VARIANTS["watch-namespaces"]))["spec"]["template"][
        "spec"
    ]["containers"]
    assert [
        arg for arg in container["args"] if arg.startswith("--namespace") or arg == "--all-namespaces"
    ] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "--verbose" in container["args"]


def test_digest_wins_over_tag(helm: Any) -> None:
    pod = operator_deployment(helm.render(*VARIANTS["pinned-digest"]))["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "ghcr.io/inflight-dev/inflight-operator@sha256:" + "a" * 64
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_existing_service_account_is_used_not_created(helm: Any) -> None:
    objects = helm.render(*VARIANTS["existing-service-account"])
    assert by_kind(objects, "ServiceAccount") == []
    assert operator_deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (("--set", "replicaCount=-1"), "/replicaCount"),
        (("--set", "verbose=yes"), "/verbose"),
        (("--set", "watchNamespaces={Team_A}"), "/watchNamespaces/0"),
        (("--set", "leaderElection.enabled=false"), "leaderElection.enabled=false needs replicaCount 1"),
        (("--set", "image.pullPolicy=Sometimes"), "/image/pullPolicy"),
        (("--set", "image.digest=sha256:abc"), "/image/digest"),
        (("--set", "replicas=2"), "additional properties 'replicas' not allowed"),
        (("--set", "healthPort=80"), "/healthPort"),
        (("--set", "builtinAutoscaling.intervalSeconds=0"), "/builtinAutoscaling/intervalSeconds"),
        (
            ("--set", "serviceAccount.create=false"),
            "serviceAccount.name must name an existing ServiceAccount",
        ),
    ],
)
def test_bad_values_are_rejected_with_the_reason(helm: Any, values: tuple[str, ...], complaint: str) -> None:
    result = helm.template(*values)
    assert result.returncode != 0
    assert complaint in result.stderr


def test_notes_say_what_to_apply_next(helm: Any) -> None:
    result = helm.run(
        "install", "--dry-run=client", helm.release, str(helm.chart), "--namespace", helm.namespace
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout[result.stdout.index("NOTES:") :]
    assert f"kubectl -n {helm.namespace} rollout status deployment/inflight" in notes
    example = helm.root / "manifests" / "tiny-cpu.yaml"
    assert "kubectl apply -f manifests/tiny-cpu.yaml" in notes and example.is_file()
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    assert f"kubectl describe modelserver {name} " in notes
    assert "kubectl apply --server-side -f crds/modelserver.yaml" in notes


def test_disruption_budget_only_with_standbys(helm: Any) -> None:
    objects = helm.render()
    (budget,) = by_kind(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    pod_labels = operator_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert by_kind(helm.render(*VARIANTS["no-leader-election"]), "PodDisruptionBudget") == []
    assert by_kind(helm.render("--set", "podDisruptionBudget.enabled=false"), "PodDisruptionBudget") == []
