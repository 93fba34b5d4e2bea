"""A request's tree budget from its acceptance and measured draft cost: the policy half of speculation.

:class:`AdaptiveBudget` decides how many tree nodes a request *asks* for; the scheduler grants it or less and
the executor's step gate (:class:`~specstream.schedulers.costmodel.SpecGate`) decides whether the batch's trees
pay together. It holds no tensor and no model, so the live executor
(:mod:`specstream.stages.speculative.executor`) and the simulator (:mod:`specstream.schedulers.simulator`) run
the same policy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveBudget:
    """Per-request tree size from recent acceptance and measured draft cost (never slower than no drafts).

    An exponential moving average of accepted draft tokens per step (``ema``) decides the node budget the
    request *asks* for; the scheduler grants it or less. A step with drafts commits about ``1 + ema`` tokens
    and costs about ``1 + cost_ratio`` plain steps (``cost_ratio`` = measured draft time / verify time), so
    speculation is switched off when ``(1 + ema) / (1 + cost_ratio) < 1`` or ``ema < off_below``, except for a
    small probe tree every ``probe_every`` steps, so a request whose drafts become good again gets them back.

    **Depth by cost** (when the executor knows the draft's cost per tree level, ``depth_cost`` = draft time per
    level / a plain step's time, the verify cost of each extra tree node, ``node_cost`` = seconds per verified
    token x decoding rows / a plain step's time, and the tree's shape, ``depth_nodes[d]`` = nodes of the
    configured tree cut after depth ``d``, root included): the request asks for the depth ``d`` that maximises the
    expected speed-up of a step over a plain one,
    ``(1 + sum_{i=1..d} alpha^i) / (1 + depth_cost * d + node_cost * (depth_nodes[d] - 1))``, where ``alpha`` is
    the per-level acceptance rate
    estimated from the steps seen (accepted levels over accepted levels plus rejections: a step that accepted
    ``k`` of ``D`` levels is ``k`` hits and one miss when ``k < D``). A deep tree whose draft costs more than its
    acceptance earns is shortened instead of switched off; ``d = 0`` switches drafting off (with probes). The
    same trade-off as the draft-length controllers of "SpecDec++" (Huang et al. 2024) and vLLM's speculative
    length tuning, here per request from measured costs. What a request asks for is decided for it alone; whether
    the batch's trees pay together (every node is a token of the shared target forward) is the executor's step
    gate's decision (:class:`~specstream.schedulers.costmodel.SpecGate`), which reads :attr:`alpha`.
    """

    full_nodes: int
    min_nodes: int = 4
    ema: float = 1.0
    decay: float = 0.7
    off_below: float = 0.2
    probe_every: int = 8
    steps_off: int = 0
    #: nodes (root included) of the configured tree cut after depth d, for d = 0..max depth; () = unknown
    depth_nodes: tuple[int, ...] = ()
    #: decayed counts of accepted levels and of rejections (the per-level acceptance estimate)
    hits: float = 1.0
    misses: float = 0.0
    #: what is left in ``hits`` of its initial optimistic 1.0 (decays with every observed step)
    prior: float = 1.0
    #: the deepest tree the request's own evidence supports, in draft levels (a slow start, as TCP's): one level
    #: until a step with drafts was observed (the first tree rests on other requests' acceptance, which may be
    #: another kind of prompt's: a missed 4-level tree costs 4 draft forwards and 4 verified rows where one level
    #: measures the same), then 4, then twice the longest run of levels it has had accepted in one step. The step
    #: gate never grants the request a deeper tree: one accepted level measures an acceptance of 1.0, which alone
    #: would justify a 16-level tree (16 draft forwards) on the next step.
    ramp: int = 1

    def observe(self, num_accepted: int, proposed: int, depth: int | None = None) -> None:
        """Book one verification step: ``num_accepted`` draft tokens accepted out of a ``proposed``-node tree
        ``depth`` levels deep (None: a chain, ``proposed - 1``)."""
        if proposed <= 1:
            self.steps_off += 1
            return
        self.ema = self.decay * self.ema + (1 - self.decay) * num_accepted
        depth = proposed - 1 if depth is None else depth
        self.hits = self.decay * self.hits + (1 - self.decay) * num_accepted
        self.prior *= self.decay
        self.misses = self.decay * self.misses + (1 - self.decay) * (1.0 if num_accepted < depth else 0.0)
        self.steps_off = 0
        self.ramp = max(self.ramp, 4, 2 * num_accepted)

    @property
    def alpha(self) -> float:
        """Estimated probability that a draft level is accepted, given the levels above it were."""
        total = self.hits + self.misses
        return self.hits / total if total > 0 else 0.0

    @property
    def measured_alpha(self) -> float | None:
        """:attr:`alpha` from the observed steps alone (the optimistic prior left out), once a step with drafts
        was observed; None before: what the step gate weighs (a request with none weighs the workload's)."""
        hits = self.hits - self.prior
        total = hits + self.misses
        return hits / total if total > 1e-9 else None

    def best_depth(self, depth_cost: float, node_cost: float = 0.0) -> int:
        """The depth (0 = no drafts) with the highest expected tokens per unit of step time."""
        a, gain, best, best_d, expected = self.alpha, 0.0, 1.0, 0, 1.0
        for d in range(1, len(self.depth_nodes)):
            gain = a if d == 1 else gain * a
            expected += gain
            cost = 1.0 + max(0.0, depth_cost) * d + max(0.0, node_cost) * (self.depth_nodes[d] - 1)
            speedup = expected / cost
            if speedup > best + 1e-9:
                best, best_d = speedup, d
        return best_d

    def pays(self, cost_ratio: float = 0.0) -> bool:
        return self.ema >= self.off_below and (1.0 + self.ema) / (1.0 + max(0.0, cost_ratio)) >= 1.0

    def requested_nodes(self, cost_ratio: float = 0.0, depth_cost: float | None = None,
                        node_cost: float = 0.0) -> int:
        """Tree size (root included) to ask for next step; 1 = no drafts.

        ``depth_cost`` (draft time per tree level / verify time) with known ``depth_nodes`` selects the depth
        by cost (class docstring); otherwise ``cost_ratio`` (draft time / verify time of the whole tree) and the
        acceptance average decide between the full tree, a smaller one and none.
        """
        if depth_cost is not None and len(self.depth_nodes) > 1 and self.ema >= self.off_below:
            d = self.best_depth(depth_cost, node_cost)
            if d == 0:
                return self.min_nodes if self.steps_off + 1 >= self.probe_every else 1
            return min(self.full_nodes, self.depth_nodes[d])
        if not self.pays(cost_ratio):
            return self.min_nodes if self.steps_off + 1 >= self.probe_every else 1
        if self.ema >= 1.0:
            return self.full_nodes
        return max(self.min_nodes, min(self.full_nodes, int(round(self.full_nodes * self.ema))))
