"""Paged KV cache bookkeeping: a pool of blocks, per-sequence block tables, prefix caching (no torch).

The model's K/V tensors live elsewhere (one [num_blocks, block_size, kv_heads, head_dim] pair per layer);
this module only decides which block ids each sequence uses.

- Ref counts: a block is owned by every sequence whose table holds it (prefix sharing, n > 1 forks).
- Prefix caching: once a block is full, it is keyed by sha256(key of the previous block + its token ids),
  a cryptographic chain over full blocks, so identical prompt prefixes map to the same blocks and no
  crafted prompt can collide with another's key (Python's 64-bit `hash()` could be inverted). The chain
  starts at a digest of the request's extra keys (its `cache_salt`; a LoRA id would go there too), so
  requests with different salts never share blocks.
- Freed blocks keep their cached contents and stay reusable until allocation needs them: free blocks
  are handed out least-recently-freed first, uncached blocks before cached ones, and a sequence's tail
  blocks before its head blocks (heads are the likeliest shared prefixes).
- Copy-on-write: writing into a partially filled block that another sequence also holds (after a fork)
  first moves the writer to a fresh block; the (src, dst) pair is queued for the scheduler to
  hand to the runner (`take_pending_copies()`), which copies K/V before the step runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# sha256 digest (32 bytes) of the parent block's key and this block's token ids.
BlockKey = bytes
KEY_DOMAIN = b"inflight-prefix-cache-v1\0"


def chain_root(cache_salt: str | None) -> BlockKey:
    """The key the chain of a request's first block hangs from: a digest of its extra keys."""
    return hashlib.sha256(KEY_DOMAIN + json.dumps({"cache_salt": cache_salt}).encode()).digest()


def block_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """sha256(parent digest + token ids as 8-byte little-endian integers)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(parent + ids.tobytes()).digest()


class KVAllocator(Protocol):
    """What the scheduler and the engine ask of KV memory. `KVCacheManager` (paged) is the engine's;
    `ContiguousKVCache` (`contiguous_kv.py`) is the pre-PagedAttention one the demo compares it with.

    `num_blocks * block_size` is the pool's capacity in tokens; `allocate` returns False (changing
    nothing) when the memory is short.
    """

    num_blocks: int
    block_size: int

    def blocks_for(self, num_tokens: int) -> int: ...
    def holds(self, seq_id: str) -> bool: ...
    def block_table(self, seq_id: str) -> list[int]: ...
    def match_prefix(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int: ...
    def allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool: ...
    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None: ...
    def truncate(self, seq_id: str, num_tokens: int) -> None: ...
    def fork(self, parent_id: str, child_id: str) -> None: ...
    def free(self, seq_id: str) -> None: ...
    def take_pending_copies(self) -> list[tuple[int, int]]: ...
    def stats(self) -> KVCacheStats: ...


@dataclass
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int


class KVCacheManager:
    """Block pool + block tables keyed by sequence id.

    Call order per sequence: `match_prefix` (optional, once, before the first allocation) ->
    `allocate` (every step that computes tokens) -> `cache_full_blocks` (after the step computed them)
    -> `free` (when finished, aborted or preempted). `fork` gives a new sequence the same blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Blocks with ref count 0, in the order allocation takes them (front first).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Per sequence: keys of its leading full blocks that have been computed (the hash chain so far),
        # and the root its chain starts from (its cache salt).
        self._seq_keys: dict[str, list[BlockKey]] = {}
        self._seq_roots: dict[str, BlockKey] = {}
        self._default_root = chain_root(None)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ---- figures

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still hold reusable cached prefixes)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self._cached),
            usage=self.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_evictions=self.num_evictions,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's blocks in token order (empty if it holds none). Do not mutate."""
        return self._tables.get(seq_id, [])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call; the caller performs them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tables

    # ---- prefix caching

    def cached_block(self, key: BlockKey) -> int | None:
        """The block cached under `key`, if any."""
        return self._cached.get(key)

    def match_prefix(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Give a sequence that holds no blocks the cached blocks of its longest cached prefix.

        Only full blocks match, and at least one token is always left to compute (the step must produce
        logits for the last token); only blocks cached under the same `cache_salt` match. Returns the
        number of tokens now in the cache for it.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; match_prefix comes first")
        self._tables[seq_id] = []
        self._seq_keys[seq_id] = []
        root = self._default_root if cache_salt is None else chain_root(cache_salt)
        self._seq_roots[seq_id] = root
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_full = max(len(token_ids) - 1, 0) // bs  # an empty query (a prompt-logprobs request) is 0
        self.prefix_cache_queries += num_full * bs
        parent = root
        for i in range(num_full):
            key = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(key)
            if block is None:
                break
            self._take(block)
            self._tables[seq_id].append(block)
            self._seq_keys[seq_id].append(key)
            parent = key
        hits = len(self._tables[seq_id]) * bs
        self.prefix_cache_hits += hits
        return hits

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the blocks the first `num_computed_tokens` tokens filled, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        keys = self._seq_keys[seq_id]
        table = self._tables[seq_id]
        bs = self.block_size
        for i in range(len(keys), num_computed_tokens // bs):
            parent = keys[-1] if keys else self._seq_roots.get(seq_id, self._default_root)
            key = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(key)
            block = table[i]
            if key not in self._cached and self._block_keys[block] is None:
                self._cached[key] = block
                self._block_keys[block] = key

    # ---- allocation

    def can_allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        return self._blocks_short(seq_id, num_computed_tokens, num_new_tokens) <= len(self._free)

    def _blocks_short(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        table = self._tables.get(seq_id, [])
        need = self.blocks_for(num_computed_tokens + num_new_tokens) - len(table)
        if self._needs_copy(table, num_computed_tokens, num_new_tokens):
            need += 1
        return max(need, 0)

    def _needs_copy(self, table: list[int], num_computed_tokens: int, num_new_tokens: int) -> bool:
        return (
            num_new_tokens > 0
            and num_computed_tokens % self.block_size != 0
            and len(table) > num_computed_tokens // self.block_size
            and self.ref_counts[table[num_computed_tokens // self.block_size]] > 1
        )

    def allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make the table cover `num_computed_tokens + num_new_tokens` tokens, copying a shared partial block.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        if not self.can_allocate(seq_id, num_computed_tokens, num_new_tokens):
            return False
        table = self._tables.setdefault(seq_id, [])
        self._seq_keys.setdefault(seq_id, [])
        if self._needs_copy(table, num_computed_tokens, num_new_tokens):
            i = num_computed_tokens // self.block_size
            src = table[i]
            dst = self._pop_free()
            self._release(src)
            table[i] = dst
            self.pending_copies.append((src, dst))
        for _ in range(self.blocks_for(num_computed_tokens + num_new_tokens) - len(table)):
            table.append(self._pop_free())
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep only the blocks of the sequence's first `num_tokens` tokens (the KV of rejected speculative
        tokens past them is dropped; the kept blocks' stale slots are overwritten before they are read)."""
        table = self._tables[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the same blocks as `parent_id` (shared by ref count)."""
        table = self._tables[parent_id]
        for block in table:
            self.ref_counts[block] += 1
        self._tables[child_id] = list(table)
        self._seq_keys[child_id] = list(self._seq_keys[parent_id])
        if parent_id in self._seq_roots:
            self._seq_roots[child_id] = self._seq_roots[parent_id]

    def free(self, seq_id: str) -> None:
        """Drop the sequence's hold on its blocks (tail first). Unknown ids are ignored."""
        table = self._tables.pop(seq_id, None)
        self._seq_keys.pop(seq_id, None)
        self._seq_roots.pop(seq_id, None)
        for block in reversed(table or []):
            self._release(block)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise AssertionError(f"block {block} freed more often than taken")
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self._block_keys[block] is None:
                self._free.move_to_end(block, last=False)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_keys[block]
        if key is not None:
            del self._cached[key]
            self._block_keys[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def check_consistency(self) -> None:
        """Raise AssertionError if the bookkeeping contradicts itself (used by the property tests)."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        for block in range(self.num_blocks):
            rc = self.ref_counts[block]
            assert rc >= 0, f"block {block} has ref count {rc}"
            assert rc == owners[block], f"block {block}: ref count {rc}, held by {owners[block]} tables"
            assert (rc == 0) == (block in self._free), f"block {block}: ref count {rc} vs free list"
        for key, block in self._cached.items():
            assert self._block_keys[block] == key, f"cached block {block} has a stale key"
        assert self._seq_roots.keys() <= self._tables.keys(), "a freed sequence kept its chain root"
