"""The contract between the engine's runner, the model and the paged-attention kernels.

A step's batch is "flattened": the new tokens of every scheduled sequence are concatenated into one
1-D token tensor of length T; sequence i owns rows query_start_loc[i]:query_start_loc[i+1].
A sequence's new tokens are the last `query_len` tokens of its context of length `seq_len`
(so prefill, chunked prefill, prefix-cache hits and decode are one case: query_len == 1 is decode).
Query token j of sequence i sits at position seq_len - query_len + j and attends causally to keys
0..that position, read through the sequence's block table.

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block block_table[t // block_size] at offset t % block_size;
its "slot" is block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

# A step whose sequences have at most this many new rows each (decode steps, speculative verify steps of up
# to seven proposals, the shortest prompts) may run every row as a one-token decode (rows_as_decodes).
SHORT_QUERY_LEN = 8


@dataclass
class AttentionMetadata:
    # [T] int64: the slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: cumulative query lengths (starts at 0).
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32, padded with 0 (never read past seq_len).
    block_tables: torch.Tensor
    # Host-side copies, so the torch path needs no device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    # Mistral-style sliding window (keys older than `sliding_window` positions are masked); None = off.
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def is_short_queries(self) -> bool:
        return self.max_query_len <= SHORT_QUERY_LEN

    @cached_property
    def rows_as_decodes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([T] int64, [T] int64, [T] int32) on the host: every query row as a one-token decode: the row, its
        sequence's index and how many keys it attends (its position + 1; the step's keys and values are
        written before attention reads them, so a sequence's later rows see its earlier ones). For a
        decode-only step this is decode_rows."""
        starts = self.query_start_loc.tolist()
        rows: list[int] = []
        seqs: list[int] = []
        lens: list[int] = []
        for i, (query_len, seq_len) in enumerate(zip(self.query_lens_list, self.seq_lens_list, strict=True)):
            rows += range(starts[i], starts[i] + query_len)
            seqs += [i] * query_len
            lens += range(seq_len - query_len + 1, seq_len + 1)
        return (
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(seqs, dtype=torch.int64),
            torch.tensor(lens, dtype=torch.int32),
        )

    @cached_property
    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([D] int64, [D] int64, [D] int32) on the host, for the D sequences with one new token: its query
        row, the sequence's index and how many keys it attends (the sequence's length). Made once per step
        (the metadata is the step's), not once per layer."""
        decode = [i for i, query_len in enumerate(self.query_lens_list) if query_len == 1]
        starts = self.query_start_loc.tolist()
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
        lens = torch.tensor([self.seq_lens_list[i] for i in decode], dtype=torch.int32)
        return rows, torch.tensor(decode, dtype=torch.int64), lens

    @cached_property
    def prompts(self) -> torch.Tensor:
        """[P, 4] int64 on the host, for the P sequences with more than one new token (prefill, chunked
        prefill): the sequence's index, its first query row, query_len, seq_len. Made once per step."""
        starts = self.query_start_loc.tolist()
        table = [
            [i, starts[i], query_len, self.seq_lens_list[i]]
            for i, query_len in enumerate(self.query_lens_list)
            if query_len > 1
        ]
        return torch.tensor(table, dtype=torch.int64).reshape(-1, 4)

    def last_rows(self, seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The query rows of the last new token of each of `seqs`, and metadata that attends only those rows:
        each is a one-token query over its sequence's whole context, as in a decode step.

        The model's last layer uses it when only those rows' outputs are read (no prompt logprobs): the
        other rows' keys and values are written, but their attention and MLP are skipped."""
        device = self.seq_lens.device
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        rows = self.query_start_loc.to(torch.long)[index + 1] - 1
        seq_lens_list = [self.seq_lens_list[i] for i in seqs]
        meta = replace(
            self,
            slot_mapping=self.slot_mapping[rows],
            query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens[index],
            block_tables=self.block_tables[index],
            query_lens_list=[1] * len(seqs),
            seq_lens_list=seq_lens_list,
            max_query_len=1,
            max_seq_len=max(seq_lens_list),
        )
        return rows, meta
