"""Monitoring tests: the helpers are in tests/support/monitoring_kit.py."""

from __future__ import annotations

from typing import Any

import pytest

from support.monitoring_kit import ALL_MONITORING, PrometheusTools, find_prometheus_tools, render_chart


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
