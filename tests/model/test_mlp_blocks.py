"""A CPU MLP's prompt rows in blocks (llama.MLP_BLOCK_BYTES): how many blocks, and the same result as the
whole product."""

from __future__ import annotations

import pytest
import torch
from engine.test_decode_layer import _config

from inflight.engine.cpu.linear import can_prepack, prepack_linears
from inflight.engine.model import llama

CPU = torch.device("cpu")


def test_blocks_keep_each_product_within_the_budget() -> None:
    mib = 2**20
    # Llama-3.2-1B's gate/up in bfloat16 (32 KiB a row) at 2048 rows: 64 MiB, four blocks of 512 rows.
    assert llama.mlp_row_blocks(2048, 2 * 8192 * 2, CPU) == 4
    # SmolLM2's in float32 (12 KiB a row): 24 MiB, two blocks; 1365 rows make 16 MiB less 4 KiB, one.
    assert llama.mlp_row_blocks(2048, 2 * 1536 * 4, CPU) == 2
    assert llama.mlp_row_blocks(1365, 2 * 1536 * 4, CPU) == 1
    assert llama.mlp_row_blocks(64, 2 * 8192 * 2, CPU) == 1
    # A row larger than the budget alone: one row a block, never more blocks than rows.
    assert llama.mlp_row_blocks(3, 17 * mib, CPU) == 3
    assert llama.mlp_row_blocks(2048, 2 * 8192 * 2, torch.device("cuda")) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prepacked", [False, True])
def test_blocks_give_the_whole_product(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, prepacked: bool
) -> None:
    if prepacked and not can_prepack(CPU, dtype):
        pytest.skip(f"no oneDNN prepacking for {dtype} here")
    config = _config(bias=False, window=None)  # the decode-layer tests' small model: its MLP
    torch.manual_seed(0)
    mlp = llama.MLP(config, llama.shard_layout(config)).to(dtype)
    if prepacked:
        prepack_linears(mlp, batch_size_hint=64)
    x = torch.randn(37, config.hidden_size).to(dtype)
    row_bytes = 2 * config.intermediate_size * x.element_size()
    with torch.inference_mode():
        whole = mlp(x)
        # Blocks of 10 rows: 37 rows in four blocks (10, 9, 9, 9 rows).
        monkeypatch.setattr(llama, "MLP_BLOCK_BYTES", 10 * row_bytes)
        assert llama.mlp_row_blocks(37, row_bytes, CPU) == 4
        blocks = mlp(x)
    # Within rounding: MKL's float32 product (the unpacked one) sums in another order at other row counts.
    torch.testing.assert_close(blocks, whole)
