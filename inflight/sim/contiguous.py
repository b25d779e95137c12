"""KV memory as servers before PagedAttention allocated it: one contiguous region per request, reserved
up front for the longest the request may grow, and held until it finishes (no torch).

The region is a run of token positions in one buffer of `capacity_tokens`, taken first-fit, so free
space can also be split into holes no request fits (external fragmentation). Its size comes from
`reservation(seq_id)`: the model's max_model_len, or the request's prompt + max_tokens. The scheduler
drives it through the same `KVAllocator` calls as the paged `KVCacheManager`; a request is admitted
only when its whole reservation fits, and it never needs more memory after that, so it is never
preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Region:
    start: int
    reserved: int
    written: int = 0


class ContiguousKVCache:
    """First-fit contiguous reservations over `capacity_tokens`; a `KVAllocator` with block_size 1."""

    block_size = 1

    def __init__(self, capacity_tokens: int, reservation: Callable[[str], int]) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"need capacity_tokens >= 1, got {capacity_tokens}")
        self.num_blocks = capacity_tokens
        self.reservation = reservation
        self._regions: dict[str, Region] = {}

    # ---- figures

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks

    @property
    def reserved_tokens(self) -> int:
        return sum(region.reserved for region in self._regions.values())

    @property
    def written_tokens(self) -> int:
        return sum(region.written for region in self._regions.values())

    def holes(self) -> list[tuple[int, int]]:
        """The free (start, length) runs, in address order."""
        holes, position = [], 0
        for region in sorted(self._regions.values(), key=lambda r: r.start):
            if region.start > position:
                holes.append((position, region.start - position))
            position = region.start + region.reserved
        if position < self.num_blocks:
            holes.append((position, self.num_blocks - position))
        return holes

    # ---- the KVAllocator calls

    def blocks_for(self, num_tokens: int) -> int:
        return num_tokens

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._regions

    def block_table(self, seq_id: str) -> list[int]:
        """One region, no blocks: the table is empty."""
        return []

    def match_prefix(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """No prefix sharing: every token is computed into the request's own region."""
        return 0

    def allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Reserve the request's whole region on its first call; later calls only write into it.

        False (nothing changed) when no hole holds the reservation.
        """
        needed = num_computed_tokens + num_new_tokens
        region = self._regions.get(seq_id)
        if region is None:
            size = max(self.reservation(seq_id), needed)
            start = next((start for start, length in self.holes() if length >= size), None)
            if start is None:
                return False
            region = self._regions[seq_id] = Region(start=start, reserved=size)
        if needed > region.reserved:
            raise ValueError(f"{seq_id} needs {needed} tokens but reserved {region.reserved}")
        region.written = needed
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """The region stays reserved; only what is written shrinks."""
        region = self._regions[seq_id]
        region.written = min(region.written, num_tokens)

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Nothing is shared, so nothing is registered."""

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("contiguous reservations are not shared: parallel sampling (n > 1) needs paged KV")

    def free(self, seq_id: str) -> None:
        self._regions.pop(seq_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return []

    def check_consistency(self) -> None:
        """Raise AssertionError if regions overlap, leave the buffer, or hold more than they reserved."""
        position = 0
        for region in sorted(self._regions.values(), key=lambda r: r.start):
            assert region.start >= position, f"region at {region.start} overlaps the one before it"
            assert 0 <= region.written <= region.reserved, f"region at {region.start} wrote past its end"
            position = region.start + region.reserved
        assert position <= self.num_blocks, f"regions end at {position}, past {self.num_blocks}"
