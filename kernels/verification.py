"""Token-tree verification on the device, batched over requests: greedy matching and multi-step speculative
sampling (SpecInfer, Miao et al. 2024, §4.3; the batched residual form follows vLLM's rejection sampler).

Vocabulary used throughout:

- **target distribution** ``p``: the target model's next-token distribution at a tree node, after the warpers.
- **draft distribution** ``q``: the distribution a drafter sampled a child from.
- **accepted token**: a draft token the verifier keeps; accepted tokens form one root-to-node path.
- **bonus token**: the token the target itself contributes after the last accepted node (its argmax, or a
  sample from the final residual). Every step commits ``accepted + 1`` tokens.
- **residual** ``r``: the distribution still to be matched at a node after rejected proposals.

Greedy verification accepts the longest path whose every token equals the target's argmax at its parent.

Stochastic verification walks each tree from the root. At a node with target distribution ``p`` it sets
``r = p`` and tests the node's draws **in draw order** (:mod:`specstream.stages.speculative.tree`):

- a draw ``x`` *sampled* from ``q`` is accepted with probability ``min(1, r(x) / q(x))``; on rejection
  ``r <- normalize(max(r - q, 0))`` (speculative sampling, Leviathan et al. 2023; Chen et al. 2023);
- a draw ``x`` proposed *deterministically* is a point mass: accepted with probability ``r(x)``; on rejection
  ``r <- normalize(r with r(x) = 0)``.

Each test leaves the distribution of "accepted token, else a sample from the new residual" equal to ``r``, so
the emitted token is distributed exactly as ``p``. A residual that sums to zero falls back to ``p``. A token
with ``p(x) = 0`` is never accepted (strict ``u < ratio``). Every draw has its own uniform (its index in the
tree's draw log) and the bonus one more, drawn on the host from the request's own random stream, so a request's
randomness never depends on its batch neighbours.

Everything here runs on the tensors' device: the loops are over tree depth and draws per parent (host ints
known from the compiled trees), never over requests, nodes or the vocabulary. :func:`path_from_last` turns the
last accepted node into the committed path; only token ids, counts and flags cross to the host afterwards, in
one copy (:mod:`specstream.stages.speculative.executor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.kernels.trees import CompiledTrees


@dataclass
class VerifyOut:
    """Verification of a batch of trees (device tensors).

    Attributes:
        last: ``[B]`` the last accepted node (0: nothing accepted).
        bonus: ``[B]`` the target's own token after it.
    """

    last: torch.Tensor
    bonus: torch.Tensor


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples of non-negative (unnormalised) rows; never a zero-mass token.

    Args:
        weights: ``[N, V]``.
        uniforms: ``[N]`` or ``[N, k]`` in ``[0, 1)``.

    Returns:
        ``[N]`` or ``[N, k]`` token ids.
    """
    squeeze = uniforms.ndim == 1
    u = uniforms[:, None] if squeeze else uniforms
    cdf = weights.cumsum(-1)
    target = (u * cdf[:, -1:]).to(cdf.dtype)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    return idx[:, 0] if squeeze else idx


def verify_greedy_batch(argmax: torch.Tensor, trees: CompiledTrees, ancestors: torch.Tensor) -> VerifyOut:
    """Greedy verification of every tree at once.

    Args:
        argmax: ``[B, T]`` the target's argmax at every node (after logits processors).
        trees: the compiled trees.
        ancestors: ``[B, T, T]`` ancestor-or-self mask (:func:`~specstream.stages.speculative.tree.ancestor_matrix`).
    """
    b, t = trees.tokens.shape
    parent_pred = torch.gather(argmax, 1, trees.parents.clamp(min=0))
    node_valid = torch.arange(t, device=argmax.device)[None, :] < trees.num_nodes[:, None]
    ok = ((trees.tokens == parent_pred) & (trees.parents >= 0) & node_valid)
    ok[:, 0] = True
    accepted = ~(ancestors & ~ok[:, None, :]).any(-1)  # every ancestor-or-self matched
    score = torch.where(accepted, trees.depths, torch.full_like(trees.depths, -1))
    last = score.argmax(-1)
    bonus = torch.gather(argmax, 1, last[:, None])[:, 0]
    return VerifyOut(last, bonus)


def verify_stochastic_batch(probs: torch.Tensor, trees: CompiledTrees, uniforms: torch.Tensor) -> VerifyOut:
    """Multi-step speculative sampling over every tree at once.

    Args:
        probs: ``[B, T, V]`` target distributions (after warpers) at every node; float32 or float64.
        trees: the compiled trees (draws per parent in draw order; ``q`` rows for sampled draws).
        uniforms: ``[B, U]`` per request: one uniform per draw of its log (column = draw index), and the bonus's
            at column ``num_draws`` (``trees.host_draws``).

    Returns:
        The last accepted node and the bonus token; emitted tokens follow the target's distribution exactly.
    """
    b, t, v = probs.shape
    dev = probs.device
    rows = torch.arange(b, device=dev)
    k_max = trees.draw_child.shape[2]
    q_table = trees.q
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    r = probs[:, 0]
    one = torch.ones((), dtype=probs.dtype, device=dev)
    for _ in range(trees.max_depth):
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        nxt = cur
        p_cur = probs[rows, cur]
        for k in range(k_max):
            child = trees.draw_child[rows, cur, k]
            valid = alive & ~moved & (child >= 0)
            x = torch.gather(trees.tokens, 1, child.clamp(min=0)[:, None])[:, 0].clamp_(max=v - 1)
            u = torch.gather(uniforms, 1, trees.draw_uniform[rows, cur, k][:, None])[:, 0].to(probs.dtype)
            rx = torch.gather(r, 1, x[:, None])[:, 0]
            sampled = trees.draw_kind[rows, cur, k] == 1
            if q_table is not None:
                q = q_table[trees.draw_q[rows, cur, k]].to(probs.dtype)
                qx = torch.gather(q, 1, x[:, None])[:, 0]
                ratio = torch.where(qx > 0, torch.minimum(one, rx / qx.clamp(min=1e-38)), torch.zeros_like(rx))
                residual_s = (r - q).clamp_(min=0)
            else:
                ratio = torch.zeros_like(rx)
                residual_s = r
            accept = valid & torch.where(sampled, u < ratio, u < rx)
            reject = valid & ~accept
            residual_d = r.scatter(1, x[:, None], 0.0)
            residual = torch.where(sampled[:, None], residual_s, residual_d)
            total = residual.sum(-1, keepdim=True)
            residual = torch.where(total > 0, residual / total.clamp(min=1e-38), p_cur)
            r = torch.where(reject[:, None], residual, r)
            nxt = torch.where(accept, child, nxt)
            moved |= accept
        alive &= moved
        cur = nxt
        r = torch.where(moved[:, None], probs[rows, cur], r)
    bonus_u = torch.gather(uniforms, 1, torch.as_tensor(trees.host_draws, device=dev)[:, None])[:, 0]
    bonus = sample_inverse_cdf(r, bonus_u.to(r.dtype))
    return VerifyOut(cur, bonus)


def path_from_last(last: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Root-to-``last`` node indices ``[B, max_depth + 1]`` (padded with -1 past ``last``'s depth)."""
    b, t = depths.shape
    on_path = torch.gather(ancestors, 1, last[:, None, None].expand(b, 1, t))[:, 0]  # [B, T]
    slot = torch.where(on_path, depths, torch.full_like(depths, max_depth + 1))
    out = torch.full((b, max_depth + 2), -1, dtype=torch.long, device=depths.device)
    out.scatter_(1, slot, torch.arange(t, device=depths.device).expand(b, t).contiguous())
    return out[:, : max_depth + 1]
