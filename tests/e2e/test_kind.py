"""End to end on a real cluster: kind, the generated CRD, `inflight operator`, the tiny-cpu example.

`make e2e-kind` runs it. Needs `kind` and a running Docker daemon; skipped with the reason otherwise.
kubectl is taken from PATH or from .venv/bin (`make k8s-tools`). The operator runs on this machine
against the kind cluster (as in development), with leader election on as in the chart; the cluster's
CRD admission (structural schema, defaults checked against their CEL rules), content negotiation, strict
field validation, garbage collector and Deployment controller are real, so each refusal the emulated
API server in tests/support copies is checked here against the real one too. With
INFLIGHT_E2E_SERVER_IMAGE set to a server image loaded into kind (`kind load docker-image`),
the test also waits for the ModelServer to become Ready. INFLIGHT_E2E_KEEP=1 keeps the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "inflight-e2e"
INVALID = sorted((REPO / "tests" / "operator" / "data" / "invalid").glob("*.yaml"))
EXAMPLES = sorted(p for p in (REPO / "manifests").glob("*.yaml") if "\nkind: ModelServer\n" in p.read_text())


def _skip_reason() -> str | None:
    if shutil.which("kind") is None:
        return "kind is not installed (https://kind.sigs.k8s.io); the e2e tests need a kind cluster"
    if shutil.which("docker") is None:
        return "docker is not installed; kind runs its nodes in Docker"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker daemon is running (`docker info` failed); kind needs one"
    if _kubectl() is None:
        return "kubectl is not on PATH nor in .venv/bin (run `make k8s-tools`)"
    return None


def _kubectl() -> str | None:
    venv = REPO / ".venv" / "bin" / "kubectl"
    return shutil.which("kubectl") or (str(venv) if venv.exists() else None)


SKIP = _skip_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    existing = subprocess.run(["kind", "get", "clusters"], capture_output=True, text=True, check=True).stdout
    created = CLUSTER not in existing.split()
    if created:
        subprocess.run(
            ["kind", "create", "cluster", "--name", CLUSTER, "--wait", "180s"], check=True, timeout=600
        )
    path = tmp_path_factory.mktemp("kind") / "kubeconfig"
    config = subprocess.run(
        ["kind", "get", "kubeconfig", "--name", CLUSTER], capture_output=True, text=True, check=True
    )
    path.write_text(config.stdout)
    yield path
    if created and not os.environ.get("INFLIGHT_E2E_KEEP"):
        subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], check=False, timeout=300)


def kubectl(kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [str(_kubectl()), "--kubeconfig", str(kubeconfig), *args]
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=120)


def get(kubeconfig: Path, *what: str) -> dict[str, Any] | None:
    result = kubectl(kubeconfig, "get", *what, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in (obj or {}).get("status", {}).get("conditions") or [] if c["type"] == kind), {})


@pytest.fixture(scope="module")
def operator(kubeconfig: Path) -> Iterator[subprocess.Popen[bytes]]:
    kubectl(kubeconfig, "apply", "--server-side", "-f", str(REPO / "crds" / "modelserver.yaml"))
    kubectl(
        kubeconfig, "wait", "--for=condition=Established", "crd/modelservers.inflight.dev", "--timeout=60s"
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    command = [sys.executable, "-m", "inflight.cli", "operator", "--lease-namespace", "default"]
    command += ["--liveness", "", "--metrics-address", ""]
    process = subprocess.Popen(command, env=env, cwd=REPO)
    yield process
    process.terminate()
    process.wait(timeout=30)


def test_the_crd_is_admitted_and_established(kubeconfig: Path) -> None:
    for crd in (
        REPO / "crds" / "modelserver.yaml",
        REPO / "charts" / "inflight" / "crds" / "modelserver.yaml",
    ):
        result = kubectl(
            kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", str(crd), check=False
        )
        assert result.returncode == 0, result.stderr
    kubectl(
        kubeconfig, "wait", "--for=condition=Established", "crd/modelservers.inflight.dev", "--timeout=60s"
    )


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_modelservers_are_refused_by_the_api_server(kubeconfig: Path, path: Path) -> None:
    """The same files, and the same messages, as the emulator's and crd_check's tests."""
    kubectl(kubeconfig, "apply", "--server-side", "-f", str(REPO / "crds" / "modelserver.yaml"))
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    result = kubectl(kubeconfig, "apply", "--dry-run=server", "-f", str(path), check=False)
    assert result.returncode != 0 and expected in result.stderr, result.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_modelservers_are_accepted_and_defaulted(kubeconfig: Path, path: Path) -> None:
    kubectl(kubeconfig, "apply", "--server-side", "-f", str(REPO / "crds" / "modelserver.yaml"))
    result = kubectl(kubeconfig, "apply", "--dry-run=server", "-o", "json", "-f", str(path), check=False)
    assert result.returncode == 0, result.stderr
    answered = json.loads(result.stdout)
    for item in answered.get("items", [answered]):
        if item["kind"] == "ModelServer":
            assert item["spec"]["engine"]["blockSize"] > 0  # the CRD's defaults were applied


def test_tiny_cpu_reconciles_and_cleans_up(kubeconfig: Path, operator: subprocess.Popen[bytes]) -> None:
    kubectl(kubeconfig, "apply", "-f", str(REPO / "manifests" / "tiny-cpu.yaml"))
    ms = wait(
        lambda: condition(m := get(kubeconfig, "modelserver", "tiny"), "Sized").get("status") == "True" and m,
        60,
        "Sized",
    )
    deployment = wait(lambda: get(kubeconfig, "deployment", "tiny"), 60, "the Deployment")
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == ms["metadata"]["uid"]
    assert get(kubeconfig, "service", "tiny") is not None
    if image := os.environ.get("INFLIGHT_E2E_SERVER_IMAGE"):
        kubectl(
            kubeconfig,
            "patch",
            "modelserver",
            "tiny",
            "--type",
            "merge",
            "-p",
            json.dumps({"spec": {"image": image, "imagePullPolicy": "Never"}}),
        )
        wait(
            lambda: condition(get(kubeconfig, "modelserver", "tiny"), "Ready").get("status") == "True",
            600,
            "Ready",
        )
    kubectl(kubeconfig, "scale", "modelserver", "tiny", "--replicas", "2")
    wait(
        lambda: (get(kubeconfig, "deployment", "tiny") or {}).get("spec", {}).get("replicas") == 2,
        60,
        "2 replicas",
    )
    lease = get(kubeconfig, "lease", "inflight-operator", "-n", "default")
    assert lease is not None and lease["spec"]["holderIdentity"], "the operator did not take the Lease"
    kubectl(kubeconfig, "delete", "modelserver", "tiny", "--wait=true")
    wait(lambda: get(kubeconfig, "deployment", "tiny") is None, 120, "garbage collection of the Deployment")
    assert operator.poll() is None, "the operator exited"
