"""Which slice of a Llama-family model one tensor-parallel rank holds (Megatron style; no torch).

With N ranks, rank r holds:
- attention: query heads [r H/N, (r+1) H/N) of every layer's q projection and the matching columns of
  o_proj; KV heads [r Hkv/N, (r+1) Hkv/N) when N divides Hkv, else (N a multiple of Hkv) the one KV
  head its query heads read, so each KV head is replicated on N/Hkv ranks (as vLLM does);
- MLP: rows [r I/N, (r+1) I/N) of gate and up, the matching columns of down;
- vocabulary: rows [r ceil(V/N), (r+1) ceil(V/N)) of the embedding and the LM head (the last rank's
  slice is shorter when N does not divide V; its padding rows are zero and their logits dropped);
- in full: the RMSNorm weights; the o_proj bias (Llama attention_bias) on rank 0 only, since the
  partial outputs are summed.

The rule for a valid degree lives here once; `inflight.sizing` and the engine both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Degrees `valid_degrees` lists by default: the GPU counts of one node.
MAX_DEGREE = 8


def degree_error(num_heads: int, num_kv_heads: int, intermediate_size: int, degree: int) -> str | None:
    """Why `degree` ranks cannot split a model with these sizes (None when they can)."""
    if degree < 1:
        return f"tensor-parallel size must be >= 1, got {degree}"
    if num_heads % degree:
        return f"{degree} does not divide the {num_heads} attention heads"
    if num_kv_heads % degree and degree % num_kv_heads:
        return (
            f"{degree} neither divides the {num_kv_heads} KV heads nor is a multiple of them "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )
    if intermediate_size % degree:
        return f"{degree} does not divide the MLP's intermediate size {intermediate_size}"
    return None


def valid_degrees(
    num_heads: int, num_kv_heads: int, intermediate_size: int, up_to: int = MAX_DEGREE
) -> list[int]:
    """Every degree from 1 to `up_to` that splits this model."""
    return [
        d for d in range(1, up_to + 1) if degree_error(num_heads, num_kv_heads, intermediate_size, d) is None
    ]


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: the index ranges it holds, for a model with these sizes."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def single(
        cls, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, vocab: int
    ) -> ShardLayout:
        return cls(0, 1, num_heads, num_kv_heads, head_dim, intermediate, vocab)

    def __post_init__(self) -> None:
        error = degree_error(self.num_heads, self.num_kv_heads, self.intermediate_size, self.size)
        if error is not None:
            valid = valid_degrees(self.num_heads, self.num_kv_heads, self.intermediate_size)
            raise ValueError(
                f"tensor-parallel size {self.size} cannot split this model: {error}. "
                f"Valid sizes for it: {', '.join(map(str, valid))}."
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.size - 1}")

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.heads

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds: the one its first query head reads when replicated."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.kv_heads
        return self.first_head // (self.num_heads // self.num_kv_heads)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def first_intermediate(self) -> int:
        return self.rank * self.intermediate

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding / LM head every rank allocates (the vocabulary, padded, over N)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return min(self.rank * self.vocab_rows, self.vocab_size)

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_start + self.vocab_rows, self.vocab_size)
