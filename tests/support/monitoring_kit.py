"""Helpers of the monitoring tests: the chart rendered by the real helm, its queries, Prometheus' binaries.

`prometheus` and `promtool` come from Debian's `prometheus` package (.ci/run installs it). Without them the
tests skip with the reason, except in CI (CI=true), where a missing binary fails them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "inflight"
DASHBOARD = CHART / "dashboards" / "inflight.json"
HELM = Path(sys.prefix) / "bin" / "helm"
ALL_MONITORING = (
    "--set",
    "monitoring.podMonitor.enabled=true,monitoring.serviceMonitor.enabled=true,"
    "monitoring.prometheusRule.enabled=true,monitoring.grafanaDashboard.enabled=true",
)
# A vector selector: a metric name of ours, optionally with label matchers.
SELECTOR = re.compile(r"(inflight(?::|_operator_)[A-Za-z0-9_:]*)(\{[^}]*\})?")


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path


def find_prometheus_tools() -> PrometheusTools:
    found = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        message = (
            f"{', '.join(missing)} not installed: `apt-get install prometheus` (Debian's package; "
            ".ci/run installs it)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return PrometheusTools(Path(str(found["prometheus"])), Path(str(found["promtool"])))


def render_chart(*values: str) -> list[dict[str, Any]]:
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `make k8s-tools` first")
    result = subprocess.run(
        [str(HELM), "template", "inflight", str(CHART), "--namespace", "inflight-system", *values],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def alert_queries(groups: list[dict[str, Any]]) -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_queries() -> dict[str, str]:
    """`panel title / refId` -> PromQL, for every target of every dashboard panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']} / {target['refId']}": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }


def selectors(query: str) -> list[tuple[str, str]]:
    """(metric name, label matchers or '') of each of our series a query reads."""
    return [(match.group(1), match.group(2) or "") for match in SELECTOR.finditer(query)]
