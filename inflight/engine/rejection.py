"""Rejection sampling of a draft model's proposals (speculative decoding, Leviathan et al. 2023).

The draft drew each proposal x_j from its distribution q_j; the target's distribution at that position
is p_j. x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the emitted
token is drawn from the residual norm(max(0, p_j - q_j)) and the rest are dropped; when all are accepted
the token drawn from the target after the last proposal (the bonus) follows them. Every emitted token is
then distributed exactly as the target's own draw would be, whatever q is.
"""

from __future__ import annotations

import torch

from inflight.engine.sampler import race

# Sampler.noise streams: the draft's own draws, and the acceptance draws (the target's draw of a token,
# residual draws included, is stream 0). Seeded requests key each by (seed, index, position, stream).
DRAFT_STREAM = 1
ACCEPT_STREAM = 2


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_noise: torch.Tensor,
    bonus_token_id: int,
) -> list[int]:
    """The accepted proposals and the token after them.

    target_probs: p_1..p_k ([k, vocab], each row summing to 1 or unnormalized: rows are normalized here);
    draft_probs: q_1..q_k ([k, vocab], normalized likewise); uniforms: k draws of U(0, 1]; residual_noise:
    Exp(1) noise [k, race_draws(vocab)] for the residual draws (sampler.race); bonus_token_id: the
    target's draw after the last proposal."""
    p = target_probs / target_probs.sum(dim=-1, keepdim=True)
    q = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
    ids = torch.tensor(draft_token_ids, dtype=torch.long, device=p.device)[:, None]
    p_x = p.gather(1, ids)[:, 0]
    q_x = q.gather(1, ids)[:, 0]
    # u <= p/q, written without a division (q_x > 0: the draft drew x from q).
    rejected = (uniforms.to(p.dtype) * q_x > p_x).tolist()
    if True not in rejected:
        return [*draft_token_ids, bonus_token_id]
    j = rejected.index(True)
    residual = (p[j] - q[j]).clamp_min(0.0)
    # A rejection implies p_j(x_j) < q_j(x_j), so the residual has mass; rounding aside.
    if not bool((residual > 0).any()):
        residual = p[j]
    token = int(race(residual[None, :], residual_noise[j : j + 1])[0])
    return [*draft_token_ids[:j], token]
