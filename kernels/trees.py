"""The compiled token trees of one step: the buffers the verification kernels read.

:func:`specstream.stages.speculative.tree.compile_trees` builds them from the step's token trees; the kernels of
:mod:`specstream.kernels.verification` read them. The dataclass lives here, with the kernels, so that kernels
import nothing of the stages (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompiledTrees:
    """The trees of one step as padded tensors on the device (``B`` trees, ``T`` nodes, ``K`` draws per parent).

    Attributes:
        tokens: ``[B, T]`` token ids (0 for padding).
        parents: ``[B, T]`` parent index (-1 for roots and padding); parents precede children.
        depths: ``[B, T]`` depth (root 0; padding 0).
        num_nodes: ``[B]`` nodes per tree.
        draw_child: ``[B, T, K]`` per parent node, the child of each draw in draw order (-1: no draw).
        draw_kind: ``[B, T, K]`` ``ProposalKind`` (``specstream.stages.speculative.tree``) of each draw.
        draw_q: ``[B, T, K]`` row of :attr:`q` holding a sampled draw's draft distribution (0 otherwise).
        draw_uniform: ``[B, T, K]`` index of the draw in its tree's log (which uniform tests it).
        q: ``[Nq, V]`` draft distributions of the sampled draws (None when no draw is sampled).
        max_depth: deepest node of the batch (host int).
        host_sizes: nodes per tree (host list), draws per tree (host list).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    draw_child: torch.Tensor
    draw_kind: torch.Tensor
    draw_q: torch.Tensor
    draw_uniform: torch.Tensor
    q: torch.Tensor | None
    max_depth: int
    host_sizes: list[int]
    host_draws: list[int]

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])
