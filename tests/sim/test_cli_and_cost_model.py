"""`inflight demo --png` and the cost model's fit, save and load."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.cli import main
from inflight.sim.cost_model import CostModel, fit_cost_model, load_cost_model, save_cost_model


def test_fit_recovers_a_known_cost_model() -> None:
    samples = [
        (tokens, 0.004 + 0.0002 * tokens + noise) for tokens, noise in [(1, 1e-5), (8, -1e-5), (120, 0.0)]
    ]
    samples += [(500, 0.104), (33, 0.0106)]
    fitted = fit_cost_model(samples, source="test")
    assert fitted.fixed_s == pytest.approx(0.004, abs=2e-4)
    assert fitted.per_token_s == pytest.approx(0.0002, rel=0.02)


def test_fit_never_returns_negative_parts() -> None:
    # Noise making big steps look cheaper than small ones must not give a negative per-token cost.
    fitted = fit_cost_model([(1, 0.010), (100, 0.009), (50, 0.0095)], source="noisy")
    assert fitted.per_token_s == 0.0 and fitted.fixed_s == pytest.approx(0.0095)
    with pytest.raises(ValueError, match="at least 2"):
        fit_cost_model([(1, 0.01)], source="one")
    with pytest.raises(ValueError, match="same number of tokens"):
        fit_cost_model([(4, 0.01), (4, 0.02)], source="flat")


def test_cost_model_round_trips_and_a_bad_file_reads_as_none(tmp_path: Path) -> None:
    model = CostModel(fixed_s=0.01, per_token_s=0.001, source="saved")
    save_cost_model(model, tmp_path / "cm.json")
    assert load_cost_model(tmp_path / "cm.json") == model
    assert load_cost_model(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text('{"fixed_s": -1}')
    assert load_cost_model(tmp_path / "bad.json") is None


def test_demo_png_writes_the_picture_with_the_saved_cost_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    out = tmp_path / "demo.png"
    assert main(["demo", "--png", str(out), "--slots", "4"]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    printed = capsys.readouterr().out
    assert "built-in default" in printed and "At 4 slots" in printed

    save_cost_model(
        CostModel(fixed_s=0.002, per_token_s=0.0, source="calibrated here"), tmp_path / "demo-cost-model.json"
    )
    assert main(["demo", "--png", str(out), "--slots", "1"]) == 0
    printed = capsys.readouterr().out
    assert "calibrated here" in printed and "1.00x" in printed


def test_demo_rejects_slots_out_of_range() -> None:
    with pytest.raises(SystemExit, match="between 1 and 32"):
        main(["demo", "--png", "x.png", "--slots", "0"])
