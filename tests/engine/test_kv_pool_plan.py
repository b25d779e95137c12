"""How the engine picks its KV pool size (the smaller of the plan and what the device has free)."""

import subprocess
import sys

from inflight.engine.kv_budget import choose_num_kv_blocks


def test_requested_pool_is_cut_to_what_fits_on_a_measured_device() -> None:
    assert choose_num_kv_blocks(requested=30_708, fit=20_000, enough=10**9, measured=True) == 20_000
    assert choose_num_kv_blocks(requested=1_000, fit=20_000, enough=10**9, measured=True) == 1_000


def test_requested_pool_is_kept_where_the_budget_is_only_a_default() -> None:
    assert choose_num_kv_blocks(requested=5_000, fit=100, enough=10**9, measured=False) == 5_000


def test_derived_pool_is_capped_at_every_slot_at_full_length() -> None:
    assert choose_num_kv_blocks(requested=None, fit=20_000, enough=512, measured=True) == 512
    assert choose_num_kv_blocks(requested=None, fit=300, enough=512, measured=False) == 300


def test_sizing_and_the_engine_config_import_no_torch() -> None:
    """The engine and sizing.py plan the KV pool with one formula; the operator imports sizing torch-free."""
    modules = "inflight.sizing, inflight.engine.config, inflight.engine.dtypes"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
