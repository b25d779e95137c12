"""Monitoring tests: `kit` holds the helpers (imported by name: pytest runs with --import-mode=importlib)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kit import ALL_MONITORING, PrometheusTools, find_prometheus_tools, render_chart


@pytest.fixture(scope="session")
def prometheus_tools() -> PrometheusTools:
    return find_prometheus_tools()


@pytest.fixture(scope="session")
def monitoring_objects() -> list[dict[str, Any]]:
    """Every object of the chart with the whole monitoring kit switched on."""
    return render_chart(*ALL_MONITORING)


@pytest.fixture(scope="session")
def rule_groups(monitoring_objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (rule,) = [obj for obj in monitoring_objects if obj["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups
