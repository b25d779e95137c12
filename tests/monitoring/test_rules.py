"""The chart's PrometheusRule checked and unit-tested by Prometheus' own promtool (Debian's package)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import support.monitoring_kit as kit
from support.monitoring_kit import PrometheusTools

UNIT_TESTS = Path(__file__).parent / "alerts_test.yaml"
ALERTS = {
    "InflightKVCacheUsageHigh",
    "InflightRequestsWaitingGrowing",
    "InflightHighErrorRate",
    "InflightNoReadyReplica",
    "InflightSizingDrift",
    "InflightOperatorReconcileErrors",
}


def write_rules(groups: list[dict[str, Any]], folder: Path) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_checks_the_rendered_rules(
    prometheus_tools: PrometheusTools, rule_groups: list[dict[str, Any]], tmp_path: Path
) -> None:
    rules = write_rules(rule_groups, tmp_path)
    result = subprocess.run(
        [str(prometheus_tools.promtool), "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_every_alert_fires_in_a_promtool_unit_test(
    prometheus_tools: PrometheusTools, rule_groups: list[dict[str, Any]], tmp_path: Path
) -> None:
    alerts = {rule["alert"] for group in rule_groups for rule in group["rules"]}
    assert alerts == ALERTS
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"] for test in tests for case in test["alert_rule_test"] if case.get("exp_alerts")
    }
    assert fired == ALERTS, f"alerts without a firing unit test: {ALERTS - fired}"
    write_rules(rule_groups, tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = subprocess.run(
        [str(prometheus_tools.promtool), "test", "rules", UNIT_TESTS.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_runbook_section_in_the_docs(rule_groups: list[dict[str, Any]]) -> None:
    docs = (Path(__file__).parents[2] / "docs" / "monitoring.md").read_text()
    for group in rule_groups:
        for rule in group["rules"]:
            assert f"\n### {rule['alert']}\n" in docs, (
                f"docs/monitoring.md has no runbook for {rule['alert']}"
            )
            anchor = rule["alert"].lower()
            assert rule["annotations"]["runbook_url"].endswith(f"docs/monitoring.md#{anchor}")
            assert rule["labels"]["severity"] in ("warning", "critical")


def test_missing_prometheus_skips_locally_but_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kit.shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install prometheus"):
        kit.find_prometheus_tools()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="prometheus, promtool not installed"):
        kit.find_prometheus_tools()
