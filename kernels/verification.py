"""Token-tree verification: greedy and multi-step speculative sampling (SpecInfer, Miao et al. 2024, §4.3).

Vocabulary used throughout:

- **target distribution** ``p``: the target model's next-token distribution at a tree node, after the warpers.
- **draft distribution** ``q``: the distribution a drafter sampled a child from.
- **accepted token**: a draft token the verifier keeps; accepted tokens form one root-to-node path.
- **bonus token**: the token the target itself contributes after the last accepted node (its argmax, or a
  sample from the final residual). Every step commits ``accepted + 1`` tokens.
- **residual** ``r``: the distribution still to be matched at a node after rejected proposals.

Greedy verification accepts the longest path whose every token equals the target's argmax at its parent.

Stochastic verification walks the tree from the root. At a node with target distribution ``p`` it sets
``r = p`` and tests the node's proposals in the order they were made:

- a child ``x`` *sampled* from ``q`` is accepted with probability ``min(1, r(x) / q(x))``; on rejection
  ``r <- normalize(max(r - q, 0))`` (speculative sampling, Leviathan et al. 2023; Chen et al. 2023);
- a child ``x`` proposed *deterministically* is a point mass: accepted with probability ``r(x)``; on rejection
  ``r <- normalize(r with r(x) = 0)``.

Each test leaves the distribution of "accepted token, else a sample from the new residual" equal to ``r``, so
the emitted token is distributed exactly as ``p``. If the residual sums to zero the bonus is drawn from ``p``.
A token with ``p(x) = 0`` is never accepted (tests use a strict ``u < ratio``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from specstream.stages.speculative.tree import ProposalKind, TokenTree


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one request's tree.

    Attributes:
        path: accepted node indices, root (0) first; ``len(path) - 1`` draft tokens were accepted.
        accepted_tokens: the accepted draft tokens (root excluded).
        bonus_token: the target's own next token after the path.
    """

    path: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)


def verify_greedy(argmax: list[int], tree: TokenTree) -> VerifyResult:
    """Greedy verification.

    Args:
        argmax: per tree node, the target's argmax token (``[T]``, e.g. ``logits.argmax(-1).tolist()``).
        tree: the request's token tree (``T`` nodes).
    """
    node, path = 0, [0]
    while True:
        child = tree.child(node, argmax[node])
        if child is None:
            break
        path.append(child)
        node = child
    return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path[1:]), int(argmax[node]))


def sample_from(dist: np.ndarray, rng: random.Random) -> int:
    """Inverse-CDF sample of a (possibly unnormalized) non-negative ``[V]`` vector; never a zero-mass token."""
    cdf = np.cumsum(dist)
    total = cdf[-1]
    u = rng.random() * total
    idx = int(np.searchsorted(cdf, u, side="right"))
    return min(idx, len(dist) - 1)


def _normalize(r: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    total = r.sum()
    if not total > 0:
        return fallback.copy()
    return r / total


def verify_stochastic(probs: torch.Tensor, tree: TokenTree, rng: random.Random) -> VerifyResult:
    """Multi-step speculative sampling over a token tree.

    Args:
        probs: ``[T, V]`` target distributions (after warpers) at every tree node; float64 preferred.
        tree: the token tree; ``tree.parent_proposals`` gives each node's proposals in order.
        rng: the request's own random stream (one uniform per test, one per bonus sample).

    Returns:
        The accepted path and the bonus token; the emitted tokens follow the target's distribution exactly.
    """
    node, path = 0, [0]
    table = probs.double().cpu().numpy() if isinstance(probs, torch.Tensor) else probs

    def row(i: int) -> np.ndarray:
        return table[i]

    while True:
        p = row(node)
        r = p
        accepted = None
        for child, prop in tree.parent_proposals[node]:
            x = tree.tokens[child]
            if x >= r.shape[0]:
                continue  # an id outside the target's vocabulary can never be emitted
            u = rng.random()
            if prop.kind is ProposalKind.SAMPLED:
                q = prop.q.double().numpy() if isinstance(prop.q, torch.Tensor) else prop.q
                qx = q[x]
                if qx > 0 and u < min(1.0, r[x] / qx):
                    accepted = child
                    break
                r = _normalize(np.maximum(r - q[: r.shape[0]], 0.0), p)
            else:
                if u < r[x]:
                    accepted = child
                    break
                r = r.copy()
                r[x] = 0.0
                r = _normalize(r, p)
        if accepted is None:
            bonus = sample_from(r, rng)
            return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path[1:]), bonus)
        path.append(accepted)
        node = accepted


def verify_naive(probs: torch.Tensor, tree: TokenTree, rng: random.Random) -> VerifyResult:
    """Naive sample-and-match (SpecInfer's baseline): sample from ``p`` at each node, descend if a child matches.

    Exact in distribution too, but accepts less than :func:`verify_stochastic`. For comparisons and tests.
    """
    node, path = 0, [0]
    while True:
        tok = sample_from(probs[node].double().cpu().numpy(), rng)
        child = tree.child(node, tok)
        if child is None:
            return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path[1:]), tok)
        path.append(child)
        node = child
