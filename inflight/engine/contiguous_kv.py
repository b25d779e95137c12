"""KV memory as servers before PagedAttention allocated it: one contiguous run of blocks per request,
reserved up front for the longest the request may grow, and held until it finishes (no torch).

A request's region is `ceil(reservation / block_size)` consecutive block ids of the pool, taken first
fit, so free space can split into holes no request fits (external fragmentation). Its block table is the
region's first blocks, as many as its written tokens need: real block ids, so the engine's model runner
writes and reads its K/V exactly as it does paged blocks. The reservation comes from `reservation(seq_id)`
(tokens; `reservation_tokens` is the rule). The scheduler drives it through the same `KVAllocator` calls
as the paged `KVCacheManager`; a request is admitted only when its whole region fits, and it never needs
more memory after that, so it is never preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from inflight.engine.config import ContiguousReserve, KVAllocatorKind
from inflight.engine.kv_cache import KVCacheManager, KVCacheStats
from inflight.engine.sequence import Sequence


def reservation_tokens(
    reserve: ContiguousReserve, max_model_len: int, prompt_tokens: int, max_tokens: int
) -> int:
    """What one request reserves: the engine's max_model_len, or its own prompt + max_tokens."""
    return max_model_len if reserve == "max_model_len" else prompt_tokens + max_tokens


@dataclass
class Region:
    start: int  # first block id
    num_blocks: int
    written: int = 0  # tokens


class ContiguousKVCache:
    """First-fit runs of consecutive blocks over a pool of `num_blocks`; a `KVAllocator`."""

    def __init__(self, num_blocks: int, block_size: int, reservation: Callable[[str], int]) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reservation = reservation
        self._regions: dict[str, Region] = {}

    # ---- figures

    @property
    def num_used_blocks(self) -> int:
        return sum(region.num_blocks for region in self._regions.values())

    @property
    def reserved_tokens(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def written_tokens(self) -> int:
        return sum(region.written for region in self._regions.values())

    def stats(self) -> KVCacheStats:
        used = self.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.num_blocks - used,
            num_cached_blocks=0,
            usage=used / self.num_blocks,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_evictions=0,
        )

    def holes(self) -> list[tuple[int, int]]:
        """The free (first block, number of blocks) runs, in block order."""
        holes, position = [], 0
        for region in sorted(self._regions.values(), key=lambda r: r.start):
            if region.start > position:
                holes.append((position, region.start - position))
            position = region.start + region.num_blocks
        if position < self.num_blocks:
            holes.append((position, self.num_blocks - position))
        return holes

    # ---- the KVAllocator calls

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._regions

    def block_table(self, seq_id: str) -> list[int]:
        """The region's blocks that hold written tokens, in token order (consecutive ids)."""
        region = self._regions.get(seq_id)
        if region is None:
            return []
        return list(range(region.start, region.start + self.blocks_for(region.written)))

    def match_prefix(self, seq_id: str, token_ids: Tokens[int], cache_salt: str | None = None) -> int:
        """No prefix sharing: every token is computed into the request's own region."""
        return 0

    def allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Reserve the request's whole region on its first call; later calls only write into it.

        False (nothing changed) when no hole holds the reservation.
        """
        needed = num_computed_tokens + num_new_tokens
        region = self._regions.get(seq_id)
        if region is None:
            size = self.blocks_for(max(self.reservation(seq_id), needed))
            start = next((start for start, length in self.holes() if length >= size), None)
            if start is None:
                return False
            region = self._regions[seq_id] = Region(start=start, num_blocks=size)
        if self.blocks_for(needed) > region.num_blocks:
            raise ValueError(
                f"{seq_id} needs {needed} tokens but reserved {region.num_blocks * self.block_size}"
            )
        region.written = needed
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """The region stays reserved; only what is written shrinks."""
        region = self._regions[seq_id]
        region.written = min(region.written, num_tokens)

    def cache_full_blocks(self, seq_id: str, token_ids: Tokens[int], num_computed_tokens: int) -> None:
        """Nothing is shared, so nothing is registered."""

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("contiguous reservations are not shared: parallel sampling (n > 1) needs paged KV")

    def free(self, seq_id: str) -> None:
        self._regions.pop(seq_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return []

    def check_consistency(self) -> None:
        """Raise AssertionError if regions overlap, leave the pool, or hold more than they reserved."""
        position = 0
        for region in sorted(self._regions.values(), key=lambda r: r.start):
            assert region.start >= position, f"region at block {region.start} overlaps the one before it"
            assert 0 <= region.written <= region.num_blocks * self.block_size, (
                f"region at block {region.start} wrote past its end"
            )
            position = region.start + region.num_blocks
        assert position <= self.num_blocks, f"regions end at block {position}, past {self.num_blocks}"


def build_kv_allocator(
    kind: KVAllocatorKind,
    num_blocks: int,
    block_size: int,
    *,
    enable_prefix_caching: bool,
    reserve: ContiguousReserve,
    waiting: Callable[[], Iterable[Sequence]],
) -> KVCacheManager | ContiguousKVCache:
    """The KV allocator `kind` over `num_blocks`. A contiguous one sizes each request it admits by
    `reserve`; the request is in the scheduler's queue, `waiting()` (admission takes it from there)."""
    if kind == "paged":
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching)

    def reservation(seq_id: str) -> int:
        seq = next(seq for seq in waiting() if seq.seq_id == seq_id)
        return reservation_tokens(reserve, seq.max_model_len, seq.num_prompt_tokens, seq.max_tokens)

    return ContiguousKVCache(num_blocks, block_size, reservation)
