"""Run the real helm binary (installed into the venv by `make k8s-tools`) on charts/inflight.

pytest runs with --import-mode=importlib, so tests reach these helpers through the `helm` fixture.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


class Helm:
    root = Path(__file__).resolve().parents[2]
    chart = root / "charts" / "inflight"
    binary = Path(sys.prefix) / "bin" / "helm"
    release = "inflight"
    namespace = "inflight-system"
    kube_version = "1.32.0"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        if not self.binary.is_file():
            pytest.fail(
                f"{self.binary} is missing: run `make k8s-tools` (scripts/install_k8s_tools.py) first"
            )
        return subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, timeout=60, cwd=self.root
        )

    def template(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run(
            "template",
            self.release,
            str(self.chart),
            "--namespace",
            self.namespace,
            "--kube-version",
            self.kube_version,
            *extra,
        )

    def render(self, *extra: str) -> list[dict[str, Any]]:
        """The rendered objects (a fresh copy; helm runs once per set of arguments per session)."""
        if extra not in _RENDERED:
            result = self.template(*extra)
            assert result.returncode == 0, f"helm template {' '.join(extra)} failed:\n{result.stderr}"
            _RENDERED[extra] = result.stdout
        return [obj for obj in yaml.safe_load_all(_RENDERED[extra]) if obj]


_RENDERED: dict[tuple[str, ...], str] = {}


@pytest.fixture
def helm() -> Helm:
    return Helm()
