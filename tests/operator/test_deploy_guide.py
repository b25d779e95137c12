"""docs/deploy-gpu.md cannot drift: its shell blocks are parsed into the commands and manifests a user runs,
and each is checked against what the code does.

- `cat > FILE <<'EOF'` writes a values file; `helm install` is rendered by the real helm with the same
  arguments (Kubernetes 1.32, strict schemas), and the operator image is the one `docker build` tagged;
- `kubectl apply -f - <<'EOF'` manifests: ModelServers pass the CRD (schema + CEL) and fit their GPU,
  core kinds pass the Kubernetes 1.32 schema strictly, Ingress and HTTPRoute point at the Service the
  operator creates;
- `kubectl create secret generic` becomes the Secret it creates: valid, and exactly the names and keys the
  ModelServer references;
- the quoted plan is the sizing code's, the quoted Degraded message is what the real operator writes.
"""

from __future__ import annotations

import base64
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import kubernetes_validate
import pytest
import yaml

from inflight.operator.api import types as spec
from inflight.operator.api.crd import render_crd
from inflight.operator.api.types import ModelServer
from inflight.operator.children import server as builders
from inflight.operator.controller import Controller
from inflight.operator.kube import OPERATOR_USER_AGENT, KubeClient, configuration_for
from inflight.operator.placement import place
from inflight.operator.status import CONDITION_TYPES, condition_of

from support.crd_check import admission_errors
from support.emulated import emulated_cluster

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deploy-gpu.md"
HELM = Path(sys.prefix) / "bin" / "helm"
KUBE_VERSION = "1.32.0"
HEREDOC = re.compile(r"^(?P<command>.*)<<'EOF'$")


@dataclass
class Guide:
    commands: list[str] = field(default_factory=list)  # every command, continuation lines joined
    files: dict[str, str] = field(default_factory=dict)  # `cat > NAME <<'EOF'`
    applied: list[dict[str, Any]] = field(default_factory=list)  # `kubectl apply -f - <<'EOF'`
    quoted: list[str] = field(default_factory=list)  # ```text blocks


def parse_guide(text: str) -> Guide:
    guide = Guide()
    for language, body in re.findall(r"^ *```(\w+)\n(.*?)^ *```$", text, flags=re.MULTILINE | re.DOTALL):
        if language == "text":
            guide.quoted.append(body.strip())
            continue
        assert language == "sh", f"use ```sh or ```text blocks in the guide, not {language}"
        lines = iter(body.replace("\\\n", " ").splitlines())
        for raw in lines:
            line = raw.strip()
            heredoc = HEREDOC.match(line)
            if heredoc is None:
                if line:
                    guide.commands.append(line)
                continue
            command = heredoc["command"].strip()
            content = "\n".join(iter(lines.__next__, "EOF")) + "\n"
            guide.commands.append(command)
            if command.startswith("cat > "):
                guide.files[command.removeprefix("cat > ")] = content
            else:
                assert command == "kubectl apply -f -", command
                guide.applied += [doc for doc in yaml.safe_load_all(content) if doc]
    return guide


@pytest.fixture(scope="module")
def guide() -> Guide:
    return parse_guide(GUIDE.read_text())


def commands(guide: Guide, prefix: str) -> list[list[str]]:
    return [shlex.split(command) for command in guide.commands if command.startswith(prefix)]


def model_servers(guide: Guide) -> list[ModelServer]:
    return [ModelServer.model_validate(obj) for obj in guide.applied if obj["kind"] == "ModelServer"]


def option(argv: list[str], *names: str) -> str:
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name:
                return argv[index + 1]
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    raise AssertionError(f"{names} missing in {argv}")


def test_the_guide_covers_every_step(guide: Guide) -> None:
    steps = ("docker build", "docker push", "helm install", "kubectl -n llm create secret generic",
             "kubectl apply -f -", "kubectl -n llm get ms -w", "kubectl -n llm wait --for=condition=Ready",
             "kubectl -n llm port-forward", "kubectl -n llm scale ms", "helm uninstall")  # fmt: skip
    for prefix in steps:
        assert any(command.startswith(prefix) for command in guide.commands), prefix
    assert {obj["kind"] for obj in guide.applied} == {"ModelServer", "Ingress", "HTTPRoute"}


def test_the_model_servers_pass_the_crd_and_fit_their_gpu(guide: Guide) -> None:
    schema = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (ms,) = model_servers(guide)
    for obj in guide.applied:
        if obj["kind"] == "ModelServer":
            assert admission_errors(schema, obj) == []
    plan = place(ms.spec, []).plan
    assert plan.fits and ms.spec.resources.gpu.count >= 1
    assert "8B" in ms.spec.model.source
    assert plan.reason in guide.quoted, f"the guide's quoted plan is stale; the operator says: {plan.reason}"


def test_core_manifests_pass_kubernetes_and_routes_reach_the_operators_service(guide: Guide) -> None:
    (ms,) = model_servers(guide)
    service = builders.service(ms)
    (port,) = service["spec"]["ports"]
    for obj in guide.applied:
        if obj["kind"] == "Ingress":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            backends = [p["backend"]["service"] for r in obj["spec"]["rules"] for p in r["http"]["paths"]]
            assert backends == [{"name": service["metadata"]["name"], "port": {"number": port["port"]}}]
        if obj["kind"] == "HTTPRoute":
            assert obj["apiVersion"] == "gateway.networking.k8s.io/v1"
            refs = [ref for rule in obj["spec"]["rules"] for ref in rule["backendRefs"]]
            assert refs == [{"name": service["metadata"]["name"], "port": port["port"]}]
            assert obj["spec"]["parentRefs"] and obj["spec"]["hostnames"]
        assert obj["metadata"]["namespace"] == ms.metadata.namespace


def secrets(guide: Guide) -> list[dict[str, Any]]:
    """The Secrets `kubectl -n NS create secret generic NAME --from-literal=KEY=VALUE` creates."""
    created = []
    for argv in commands(guide, "kubectl -n"):
        if argv[3:6] != ["create", "secret", "generic"]:
            continue
        literals = [arg.removeprefix("--from-literal=") for arg in argv if arg.startswith("--from-literal=")]
        data = {
            key: base64.b64encode(value.encode()).decode()
            for key, value in (x.split("=", 1) for x in literals)
        }
        created.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": argv[6], "namespace": argv[2]}, "data": data})  # fmt: skip
    return created


def test_the_secrets_are_valid_and_exactly_what_the_model_server_references(guide: Guide) -> None:
    made = secrets(guide)
    for secret in made:
        kubernetes_validate.validate(secret, KUBE_VERSION, strict=True)
    (ms,) = model_servers(guide)
    refs = [ms.spec.model.hf_token_secret_ref, ms.spec.auth.api_key_secret_ref if ms.spec.auth else None]
    wanted = {(ms.metadata.namespace, ref.name, ref.key) for ref in refs if ref is not None}
    have = {(s["metadata"]["namespace"], s["metadata"]["name"], key) for s in made for key in s["data"]}
    assert have == wanted
    (port_forward,) = commands(guide, "kubectl -n llm port-forward")
    assert port_forward[-2:] == [f"svc/{ms.metadata.name}", f"{builders.PORT}:{builders.PORT}"]
    (curl,) = [c for c in guide.commands if c.startswith("curl ")]
    assert f'"model": "{ms.spec.model.name}"' in curl and f":{builders.PORT}/v1/chat/completions" in curl
    assert ms.spec.auth is not None
    assert any(f"jsonpath='{{.data.{ms.spec.auth.api_key_secret_ref.key}}}'" in c for c in guide.commands)


def test_helm_install_renders_with_the_images_docker_built(guide: Guide, tmp_path: Path) -> None:
    built = {option(argv, "-f"): option(argv, "-t") for argv in commands(guide, "docker build")}
    assert set(built) == {"server/Dockerfile", "operator/Dockerfile"}
    assert all((ROOT / dockerfile).is_file() for dockerfile in built)
    pushed = {argv[2] for argv in commands(guide, "docker push")}
    assert pushed == set(built.values())
    (ms,) = model_servers(guide)
    assert ms.spec.image == built["server/Dockerfile"]

    for name, content in guide.files.items():
        (tmp_path / name).write_text(content)
    (install,) = commands(guide, "helm install")
    release, chart = install[2], install[3]
    namespace = option(install, "--namespace", "-n")
    values = [str(tmp_path / option(install, "-f"))]
    result = subprocess.run(
        [
            str(HELM),
            "template",
            release,
            str(ROOT / chart),
            "--namespace",
            namespace,
            "-f",
            *values,
            "--kube-version",
            KUBE_VERSION,
            "--include-crds",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    objects = [obj for obj in yaml.safe_load_all(result.stdout) if obj]
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    (deployment,) = [obj for obj in objects if obj["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == built["operator/Dockerfile"]
    rollout = f"kubectl -n {namespace} rollout status deployment/{deployment['metadata']['name']}"
    assert rollout in guide.commands
    (uninstall,) = commands(guide, "helm uninstall")
    assert uninstall[2] == release and option(uninstall, "--namespace", "-n") == namespace
    assert f"kubectl delete crd {spec.PLURAL}.{spec.GROUP}" in guide.commands


def test_status_commands_name_the_model_server_and_a_real_condition(guide: Guide) -> None:
    (ms,) = model_servers(guide)
    (wait,) = commands(guide, "kubectl -n llm wait")
    condition = option(wait, "--for").removeprefix("condition=")
    assert condition in CONDITION_TYPES and f"{spec.SINGULAR}/{ms.metadata.name}" in wait
    (scale,) = commands(guide, "kubectl -n llm scale")
    assert scale[4:7] == [spec.SHORT_NAMES[0], ms.metadata.name, "--replicas=2"]
    assert (
        f"kubectl -n {ms.metadata.namespace} delete {spec.SHORT_NAMES[0]} {ms.metadata.name}"
        in guide.commands
    )


async def test_the_quoted_degraded_message_is_what_the_operator_writes(guide: Guide) -> None:
    """The guide's ModelServer applied before its Secrets: the real controller's Degraded message."""
    (obj,) = [dict(obj) for obj in guide.applied if obj["kind"] == "ModelServer"]
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    async with emulated_cluster() as cluster:
        response = await cluster.post(
            f"/apis/{spec.GROUP}/{spec.VERSION}/namespaces/{namespace}/{spec.PLURAL}", json=obj
        )
        assert response.status in (200, 201), await response.text()
        controller = Controller(
            KubeClient(configuration_for(str(cluster.url)), user_agent=OPERATOR_USER_AGENT), lambda *_: None
        )
        try:
            await controller.reconcile(namespace, name)
        finally:
            await controller.close()
        stored = cluster.stored(f"{spec.GROUP}/{spec.VERSION}/{spec.PLURAL}", namespace, name)
        assert stored is not None and not [
            k for k in cluster.objects if k[0] == kmock.resource("apps/v1/deployments")
        ]
    degraded = condition_of(stored["status"]["conditions"], "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "SecretNotFound"
    assert degraded["message"] in guide.quoted, (
        f"the guide's Degraded example is stale: {degraded['message']}"
    )
    assert f"`STATUS` `{degraded['reason']}`" in GUIDE.read_text()
