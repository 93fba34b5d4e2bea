"""Cost model of one engine step: per-op latency as a function of batch size, tokens, images and audio seconds.

The simulator advances its virtual clock by :meth:`CostModel.plan_s` per :class:`~specstream.schedulers.plan.
StepPlan`; the QoS scheduler uses the same model to decide whether speculation pays. Two profiles ship:

- ``cpu-2core``: **measured** on this project's 2-core CPU machine by ``python -m specstream.pipeline.calibrate``
  (2026-11-30, load average ~1, torch 2.14.1, 2 threads; a mid-size random Llama, hidden 512, 8 layers, vocab
  8192, with a same-weights draft; a random CLIP ViT-B/32 tower; a random Whisper tiny encoder): the step model
  fits its 56 steps with R^2 0.994 (median relative error 6.5 %). An earlier run's prefill points also timed
  the decodes of the requests admitted before them, which made them grow quadratically; that calibration bug
  is fixed.
- ``h200-est``: **estimated, not measured** (no GPU run was available): a roofline for a Llama-2-7B-class
  target in bfloat16 on one H200 (4.8 TB/s HBM, ~990 dense TFLOPS bf16 peak, ~50 % achieved), a 68M-parameter
  draft, CLIP ViT-L/14-336 for images and the Whisper large-v3 encoder for audio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from specstream.schedulers.plan import DecodeWork, StepPlan


@dataclass(frozen=True)
class EncodeCost:
    """Latency of one encoder batch: ``fixed_s + per_quantum_s * sum(ceil(units / quantum))`` over its items.

    Images: ``quantum`` 1 (one forward per image). Whisper audio: ``quantum`` 30 (seconds): every item is padded
    to whole 30-s windows, whatever its length.
    """

    fixed_s: float
    per_quantum_s: float
    quantum: float = 1.0

    def batch_s(self, units: list[float]) -> float:
        if not units:
            return 0.0
        return self.fixed_s + self.per_quantum_s * sum(max(1, math.ceil(u / self.quantum - 1e-9)) for u in units)


@dataclass(frozen=True)
class CostModel:
    """Per-step latency in seconds.

    target forward = ``step_fixed_s + per_row_s * rows + per_token_s * tokens + per_kv_token_s * kv_tokens``
    where ``rows`` = requests in the forward, ``tokens`` = prefill tokens + tree nodes verified,
    ``kv_tokens`` = cached tokens attended by the decode rows (sum of their context lengths).
    draft = ``draft_level_s * depth + draft_per_node_s * draft_nodes`` (one batched draft forward per tree depth).
    Encoders: :class:`EncodeCost` per modality.

    Attributes:
        name, hardware: profile name and what it describes; ``estimated`` True when not measured.
        kv_bytes_per_token: KV cache bytes per token of the target (all layers, K and V), for the byte budget.
        models: per model name of a device loop, the cost model of that model's forward (its own target and draft
            terms); rows of other models use this one. Each model that has rows in a step runs its own forward.
    """

    name: str
    hardware: str
    estimated: bool
    step_fixed_s: float
    per_row_s: float
    per_token_s: float
    per_kv_token_s: float
    draft_level_s: float
    draft_per_node_s: float
    kv_bytes_per_token: int
    encoders: dict[str, EncodeCost] = field(default_factory=dict)
    models: dict[str, "CostModel"] = field(default_factory=dict)

    def target_s(self, rows: int, tokens: int, kv_tokens: int) -> float:
        if rows == 0:
            return 0.0
        return self.step_fixed_s + self.per_row_s * rows + self.per_token_s * tokens + self.per_kv_token_s * kv_tokens

    def draft_s(self, depth: int, nodes: int) -> float:
        return self.draft_level_s * depth + self.draft_per_node_s * nodes if depth > 0 else 0.0

    @property
    def draft_read_token_s(self) -> float:
        """Seconds the draft takes per committed token it reads to catch up (a prompt, the tokens of steps it did
        not draft): a read is a prefill of the draft, so the target's seconds per token scaled by the draft's
        share of a step (``draft_level_s / step_fixed_s``)."""
        return self.per_token_s * self.draft_level_s / self.step_fixed_s if self.step_fixed_s > 0 else 0.0

    def encode_s(self, modality: str, units: list[float]) -> float:
        cost = self.encoders.get(modality)
        if cost is None:
            raise KeyError(f"cost model {self.name!r} has no encoder cost for modality {modality!r}")
        return cost.batch_s(units)

    def decode_tokens_per_s(self, batch: int, nodes: int, tau: float, context: int = 256) -> float:
        """Committed tokens per second of a decode batch where each request verifies ``nodes`` nodes and commits
        ``tau`` tokens per step (used to decide whether speculation pays at this batch size)."""
        depth = max(0, nodes - 1)
        step = self.target_s(batch, batch * nodes, batch * context) + self.draft_s(min(depth, 8), batch * depth)
        return batch * tau / step

    def plan_s(self, plan: StepPlan) -> float:
        """Latency of ``plan``: encoder batches, then per model of the device loop its draft and its target
        forward (one forward per model with rows in the step)."""
        total = sum(self.encode_s(w.modality, [it.units for _, it in w.items]) for w in plan.encodes)
        names = {p.model for p in plan.prefills} | {d.model for d in plan.decodes}
        for name in sorted(names):
            cost = self.models.get(name, self)
            pre = [p for p in plan.prefills if p.model == name]
            dec = [d for d in plan.decodes if d.model == name]
            tokens = sum(p.num_tokens for p in pre) + sum(d.node_budget for d in dec)
            kv = sum(d.context_len for d in dec)
            spec = [d for d in dec if d.node_budget > 1 and d.max_depth > 0]
            depth = max((min(d.max_depth, d.node_budget - 1) for d in spec), default=0)
            total += cost.draft_s(depth, sum(d.node_budget - 1 for d in spec))
            total += cost.target_s(len(pre) + len(dec), tokens, kv)
        return total

    def with_(self, **changes) -> "CostModel":
        return replace(self, **changes)


# Measured: ``python -m specstream.pipeline.calibrate`` on 2026-11-30 (see the module docstring).
CPU_2CORE = CostModel(
    name="cpu-2core",
    hardware="2-core x86 CPU, torch 2.14.1 float32, 2 threads; mid-size random Llama (hidden 512, 8 layers, "
             "vocab 8192), random CLIP ViT-B/32 224px, random Whisper tiny encoder (calibrated 2026-11-30)",
    estimated=False,
    step_fixed_s=0.0259,
    per_row_s=0.0,
    per_token_s=0.000479,
    per_kv_token_s=0.00000736,
    draft_level_s=0.0202,
    draft_per_node_s=0.00385,
    kv_bytes_per_token=2 * 8 * 512 * 4 // 4,  # 2 (K,V) x 8 layers x 128 kv dims (2 kv heads x 64) x 4 bytes
    encoders={"image": EncodeCost(0.0997, 0.0586, 1.0), "audio": EncodeCost(0.0, 0.375, 30.0)},
)

# Roofline estimate (NOT measured): Llama-2-7B bf16 target on one H200.
#  weights 13.5 GB / 4.8 TB/s ~ 2.8 ms per forward (memory-bound floor) + ~1 ms launch/sync overhead;
#  compute 2 * 6.7e9 FLOP per token at ~500 TFLOPS achieved ~ 27 us per token;
#  KV read: 0.5 MB per token (32 layers x 4096 x 2 x 2 B) / 4.8 TB/s ~ 0.1 us per cached token;
#  68M draft: launch-bound, ~0.35 ms per depth level; CLIP ViT-L/14-336 ~ 0.38 TFLOP/image -> ~0.8 ms/image;
#  Whisper large-v3 encoder ~ 1.2 TFLOP per 30-s window -> ~3 ms/window.
H200_EST = CostModel(
    name="h200-est",
    hardware="one NVIDIA H200 (estimated by roofline, not measured): Llama-2-7B-class bf16 target, 68M draft, "
             "CLIP ViT-L/14-336, Whisper large-v3 encoder",
    estimated=True,
    step_fixed_s=0.0038,
    per_row_s=0.00002,
    per_token_s=0.000027,
    per_kv_token_s=0.0000001,
    draft_level_s=0.00035,
    draft_per_node_s=0.000002,
    kv_bytes_per_token=32 * 4096 * 2 * 2,
    encoders={"image": EncodeCost(0.0005, 0.0008, 1.0), "audio": EncodeCost(0.0005, 0.003, 30.0)},
)

PROFILES: dict[str, CostModel] = {m.name: m for m in (CPU_2CORE, H200_EST)}


def get_profile(name: str) -> CostModel:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; known: {sorted(PROFILES)}") from None


class StepCostFit:
    """Seconds of one model's forward as ``intercept + slope x tokens``: a least-squares line through its recent
    steps, older ones forgotten by ``decay`` per step. The intercept is a step's fixed cost (weights read, drafts,
    Python), the slope what each extra token costs (a prefill chunk, a tree node). Used by the QoS scheduler
    (prefill seconds per token, mean step time) and by the executor (verify cost of tree nodes).

    Args:
        decay: weight of the previous step's sums (0.95: about the last 20 steps count).
        min_var: least variance of the steps' token counts before a slope is trusted.
    """

    def __init__(self, decay: float = 0.95, min_var: float = 4.0):
        self.decay = decay
        self.min_var = min_var
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, sum x, sum y, sum x^2, sum x*y

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        w, sx, sy, sxx, sxy = (self.decay * v for v in self._sums)
        self._sums = (w + 1, sx + tokens, sy + seconds, sxx + tokens * tokens, sxy + tokens * seconds)

    def mean_s(self) -> float | None:
        """Mean seconds of the recent steps; None before the first."""
        w, _, sy, _, _ = self._sums
        return sy / w if w > 0 else None

    def slope(self) -> float | None:
        """Seconds per token; None until the steps differ in size enough (``min_var``) or when not positive."""
        w, sx, sy, sxx, sxy = self._sums
        if w <= 0:
            return None
        var = sxx / w - (sx / w) ** 2
        if var < self.min_var:
            return None
        slope = (sxy / w - (sx / w) * (sy / w)) / var
        return slope if slope > 0 else None

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope), both positive; None otherwise."""
        slope = self.slope()
        if slope is None:
            return None
        w, sx, sy, _, _ = self._sums
        intercept = sy / w - slope * sx / w
        return (intercept, slope) if intercept > 0 else None


@dataclass(frozen=True)
class GateChoice:
    """What :class:`SpecGate` decided for one step.

    Attributes:
        depth: deepest draft level any tree of the step may reach (0: no trees this step).
        keep: per decoding row, whether it keeps a tree (False: root only).
        probe: the trees run although the gate expects them to lose (a probe, so acceptance is measured again).
        rate_on, rate_off: expected committed tokens per second with the chosen trees and with none.
    """

    depth: int
    keep: tuple[bool, ...]
    probe: bool
    rate_on: float
    rate_off: float


class SpecGate:
    """Speculation on or off for a whole step, from measured costs: the batch's expected committed tokens per
    second with the granted trees against without them.

    Per-request budgets (``AdaptiveBudget``) ask for a tree each; what a tree costs depends on the batch: every
    tree node is one more token of the shared target forward (``per_token_s`` seconds, from :class:`StepCostFit`)
    and every draft level one more draft forward (``level_s`` seconds, measured). With ``n`` decoding rows, row
    ``i``'s tree cut after depth ``d_i`` (``nodes_i`` nodes, root included) and per-level acceptance ``a_i``,

    - tokens per step = ``n + sum_i (a_i + a_i^2 + ... + a_i^d_i)``;
    - step seconds = ``fixed_s + per_token_s * (extra_tokens + n + sum_i (nodes_i - 1)) + level_s * max_i d_i
      + sum_i catch_up_i``;
    - without trees: ``n`` tokens in ``fixed_s + per_token_s * (extra_tokens + n)`` seconds.

    ``catch_up_i`` is what row ``i``'s draft must read before it can draft at all: the committed tokens it has not
    seen (its whole prompt the first time; the tokens of the steps it did not draft), ``lag_i`` tokens at the
    draft's seconds per token read. That read is paid once and serves every later step of the request, so a
    kept tree is charged its share over the steps the request has left at that depth (``remaining_i / (1 +
    a_i + ... + a_i^d_i)``). At batch 1 a prompt read is a few plain steps' time spread over the answer; at
    batch 8 it is eight of them, and drafting every row of a fresh batch once, as a fixed warm-up did, cost
    more than its trees earned (``docs/benchmarks.md``, batch 8).

    :meth:`decide` tries every batch-wide depth cap ``D`` (each tree cut after ``min(D, d_i)``), and for each drops
    the trees whose own gain, accepted tokens per second of their extra verify and catch-up cost, is below the
    batch's rate; it keeps the best cap only when it beats no trees by ``min_gain``. When it does not, the step
    runs without trees, except a probe step (the best cap, or one level where no tree was kept, for a quarter of
    the rows that asked, in turn). A probe runs only where its rows' trees could pay at all, were their drafts
    always accepted (catch-up included), after at least ``probe_every`` refused steps, and once the refused
    steps' time, times ``probe_share_of_time``, covers the probe's own extra seconds (its trees' verify, its draft
    levels, its catch-up reads charged as a kept tree's): so probing costs about that share of the time at most,
    and nothing where speculation cannot win (a large batch on a CPU). Each probe that does not switch
    speculation back on doubles the step wait, up to ``max_probe_every``. The same batch-level trade-off as the
    goodput-based speculation control of SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for
    Serving Large Language Models Using Goodput"), here from this engine's own fitted step costs. Until both costs
    are measured, :meth:`warmup` drafts one level for one row. A request that has not drafted yet is weighed at
    the acceptance observed over the other requests' drafted steps (:meth:`row_alphas`).

    The decision uses only what is known before the step's drafts are drawn (granted budgets, acceptance of
    earlier steps, measured costs, tokens the drafts have read), so a cut never depends on a drawn value: exact
    sampling is kept.

    Args:
        min_gain: least expected speed-up of the trees over a plain step (1.0: any gain).
        probe_every: refused steps before the first probe.
        max_probe_every: the longest wait between probes, in steps.
        probe_share_of_time: the most of the refused steps' time a probe may cost (0.02: 2 %).
    """

    def __init__(self, min_gain: float = 1.02, probe_every: int = 8, max_probe_every: int = 64,
                 probe_share_of_time: float = 0.02):
        if min_gain <= 0 or probe_every < 1 or max_probe_every < probe_every or not 0 < probe_share_of_time <= 1:
            raise ValueError("SpecGate: need min_gain > 0, 1 <= probe_every <= max_probe_every, "
                             "0 < probe_share_of_time <= 1")
        self.min_gain = min_gain
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_share_of_time = probe_share_of_time
        self.interval = probe_every
        self.refused = 0
        #: expected seconds of the steps refused since the last probe (plain steps of their batches)
        self.refused_s = 0.0
        #: share of the asking rows one probe drafts for (in turn)
        self.probe_share = 0.25
        self._probe_turn = 0
        #: steps decided: with trees, without (refused), probes
        self.counts = {"on": 0, "off": 0, "probe": 0}
        #: decayed accepted levels and rejections over every request's drafted steps (the workload's acceptance)
        self._hits, self._misses = 0.0, 0.0

    def observe(self, num_accepted: int, depth: int) -> None:
        """Book one row's verified tree (``num_accepted`` of ``depth`` levels accepted) into the workload's
        acceptance, the prior of requests that have not drafted yet."""
        if depth <= 0:
            return
        self._hits = 0.9 * self._hits + num_accepted
        self._misses = 0.9 * self._misses + (1.0 if num_accepted < depth else 0.0)

    @property
    def workload_alpha(self) -> float | None:
        """Per-level acceptance over the requests' drafted steps so far (None before the first)."""
        total = self._hits + self._misses
        return self._hits / total if total > 0 else None

    def row_alphas(self, measured: list[float | None]) -> list[float]:
        """The acceptance :meth:`decide` weighs per row: the row's own measured one; for a row that has not
        drafted yet, the workload's (:attr:`workload_alpha`); before anything was measured at all, 1.0 (try) for a
        quarter of those rows (at least one) and 0.0 for the rest, so the first trees of a fresh batch cost what a
        probe costs, not a catch-up read of every row's prompt."""
        prior = self.workload_alpha
        if prior is not None:
            return [prior if a is None else a for a in measured]
        unknown = [i for i, a in enumerate(measured) if a is None]
        first = set(unknown[:max(1, math.ceil(len(unknown) * self.probe_share))])
        return [a if a is not None else (1.0 if i in first else 0.0) for i, a in enumerate(measured)]

    def warmup(self, rows: list[tuple[int, int, float]], depth_nodes: tuple[int, ...] = (),
               lags: list[int] | None = None) -> GateChoice:
        """Before both costs are measured: one draft level (the cheapest measurement of a level's cost, of a
        draft token read and of the verify cost of an extra node) for the one row that asked for a tree whose
        draft has least to read (``lags``: per row, the tokens its draft has not seen; its prompt before its first
        draft). One row, not the batch: each warmed row's draft reads its whole prompt first, and at batch 8 on a
        CPU eight prompt reads cost more than a 40-token answer's trees ever earned (``docs/benchmarks.md``)."""
        lags = lags if lags is not None else [0] * len(rows)
        asking = [i for i, (b, m, _) in enumerate(rows) if b > 1 and m > 0]
        if not asking:
            return GateChoice(0, (False,) * len(rows), False, 0.0, 0.0)
        first = min(asking, key=lambda i: (lags[i], i))
        return GateChoice(1, tuple(i == first for i in range(len(rows))), False, 0.0, 0.0)

    @staticmethod
    def _shape(budget: int, max_depth: int, cap: int, depth_nodes: tuple[int, ...]) -> tuple[int, int]:
        """(nodes, depth) of a tree of at most ``budget`` nodes and ``min(max_depth, cap)`` levels; the
        configured tree's nodes per depth ``depth_nodes`` (``()``: a chain)."""
        limit = min(max_depth, cap)
        if depth_nodes:
            limit = min(limit, len(depth_nodes) - 1)
        nodes_at = (lambda d: depth_nodes[d]) if depth_nodes else (lambda d: d + 1)
        depth = 0
        while depth < limit and nodes_at(depth) < budget:
            depth += 1
        return (min(budget, nodes_at(depth)), depth) if depth > 0 else (1, 0)

    @staticmethod
    def _rate(gains, keep, shapes, n, fixed_s, per_token_s, level_s, extra_tokens, charges) -> float:
        """Expected committed tokens per second of a step (class docstring); ``gains[i][d]`` = row ``i``'s
        expected accepted tokens at depth ``d``, ``charges[i]`` its catch-up seconds charged to this step."""
        tokens, nodes, depth, extra_s = float(n), extra_tokens + n, 0, 0.0
        for g, k, (m, d), c in zip(gains, keep, shapes, charges):
            if k and d > 0:
                tokens += g[d]
                nodes += m - 1
                depth = max(depth, d)
                extra_s += c
        return tokens / (fixed_s + per_token_s * nodes + level_s * depth + extra_s)

    def decide(self, rows: list[tuple[int, int, float]], fixed_s: float, per_token_s: float, level_s: float,
               depth_nodes: tuple[int, ...] = (), extra_tokens: int = 0,
               catch_up: list[tuple[float, int]] | None = None) -> GateChoice:
        """Choose this step's trees.

        Args:
            rows: per decoding row, ``(node_budget, max_depth, alpha)``: its granted nodes (root included; 1 = no
                tree), deepest draft level allowed, and estimated per-level acceptance (0..1).
            fixed_s, per_token_s: the target forward's fitted seconds per step and per verified token.
            level_s: seconds of one draft level (one batched draft forward), measured or estimated.
            depth_nodes: nodes of the configured tree cut after each depth, root included (``()``: chains).
            extra_tokens: other tokens of the same forward (prefill chunks).
            catch_up: per decoding row, ``(seconds, remaining)``: what its drafts must read before drafting this
                step (seconds) and the tokens the request may still commit (the read is charged over the steps
                they take); None: every draft is up to date.

        Returns:
            a :class:`GateChoice`; rows that asked for no tree never get one.
        """
        n = len(rows)
        asked = [b > 1 and m > 0 for b, m, _ in rows]
        costs = (fixed_s, per_token_s, level_s, extra_tokens)
        plain_s = fixed_s + per_token_s * (extra_tokens + n)
        plain = n / plain_s if n else 0.0
        if not any(asked):
            return GateChoice(0, tuple(asked), False, plain, plain)
        catch_up = catch_up or [(0.0, 0)] * n
        max_cap = max(m for (_, m, _), a in zip(rows, asked) if a)
        by_alpha: dict[float, list[float]] = {}
        for _, _, alpha in rows:
            if alpha not in by_alpha:
                g, term = [0.0], 1.0
                for _ in range(max_cap):
                    term *= alpha
                    g.append(g[-1] + term)
                by_alpha[alpha] = g
        gains = [by_alpha[alpha] for _, _, alpha in rows]  # per row, a + a^2 + ... + a^d for d = 0..max_cap
        best = (0.0, 0, tuple([False] * n), [(1, 0)] * n)
        memo: dict[tuple[int, int, int], tuple[int, int]] = {}

        def shape(b: int, m: int, cap: int) -> tuple[int, int]:
            key = (b, m, cap)
            if key not in memo:
                memo[key] = self._shape(b, m, cap, depth_nodes)
            return memo[key]

        def charge(i: int, d: int, gain: list[float] | None = None) -> float:
            """Row ``i``'s catch-up seconds per step, spread over the steps it has left at depth ``d`` (committing
            ``1 + gain[d]`` tokens a step; ``gain``: the row's own expected acceptance unless given)."""
            seconds, remaining = catch_up[i]
            g = (gains[i] if gain is None else gain)[d]
            return seconds / max(1.0, remaining / (1.0 + g)) if seconds > 0 else 0.0

        for cap in range(1, max_cap + 1):
            shapes = [shape(b, m, cap) if a else (1, 0) for (b, m, _), a in zip(rows, asked)]
            keep = [a and d > 0 for a, (_, d) in zip(asked, shapes)]
            charges = [charge(i, d) for i, (_, d) in enumerate(shapes)]
            rate = self._rate(gains, keep, shapes, n, *costs, charges)
            for _ in range(4):  # drop trees that earn less per second of their own cost than the batch
                drop = [k and (per_token_s * (m - 1) + c) * rate > g[d]
                        for k, (m, d), g, c in zip(keep, shapes, gains, charges)]
                if not any(drop) or sum(keep) == sum(drop):
                    break
                keep = [k and not x for k, x in zip(keep, drop)]
                rate = self._rate(gains, keep, shapes, n, *costs, charges)
            if rate > best[0] and any(keep):
                best = (rate, cap, tuple(keep), shapes)
        rate_on, cap, keep, shapes = best
        if cap and rate_on >= self.min_gain * plain:
            self.interval, self.refused, self.refused_s = self.probe_every, 0, 0.0
            self.counts["on"] += 1
            return GateChoice(cap, keep, False, rate_on, plain)
        self.refused += 1
        self.refused_s += plain_s
        if self.refused >= self.interval:
            probe = self._probe_rows(asked, advance=False)
            # could the probed rows' trees pay at all, were their drafts always accepted?
            ones = [float(d) for d in range(max_cap + 1)]  # a + ... + a^d at a = 1
            hopeful = False
            for c in range(1, max_cap + 1):
                cut = [shape(b, m, c) if k else (1, 0) for (b, m, _), k in zip(rows, probe)]
                opt = [charge(i, d, ones) for i, (_, d) in enumerate(cut)]
                if self._rate([ones] * n, probe, cut, n, *costs, opt) >= self.min_gain * plain:
                    hopeful = True
                    break
            depth_cap = cap or 1  # the probe drafts the best cap's trees, one level where none was kept
            cut = [shape(b, m, depth_cap) if k else (1, 0) for (b, m, _), k in zip(rows, probe)]
            depth = max((d for _, d in cut), default=0)
            cost_s = level_s * depth + sum(per_token_s * (m - 1) + charge(i, d)
                                           for i, ((m, d), k) in enumerate(zip(cut, probe)) if k)
            if hopeful and depth and self.refused_s * self.probe_share_of_time >= cost_s:
                self._probe_rows(asked, advance=True)
                self.refused, self.refused_s = 0, 0.0
                self.interval = min(self.max_probe_every, 2 * self.interval)
                self.counts["probe"] += 1
                return GateChoice(depth_cap, probe, True, rate_on, plain)
        self.counts["off"] += 1
        return GateChoice(0, tuple([False] * n), False, rate_on, plain)

    def _probe_rows(self, asked: list[bool], advance: bool = True) -> tuple[bool, ...]:
        """The rows a probe drafts for: a quarter of those that asked (at least one), in turn from probe to
        probe, so a probe at a large batch costs a few rows' trees rather than every row's (``advance`` False:
        which rows the next probe would take, the turn kept)."""
        idx = [i for i, a in enumerate(asked) if a]
        take = max(1, math.ceil(len(idx) * self.probe_share))
        start = self._probe_turn % len(idx)
        if advance:
            self._probe_turn += take
        chosen = {idx[(start + k) % len(idx)] for k in range(take)}
        return tuple(i in chosen for i in range(len(asked)))

    def cut(self, decodes: tuple[DecodeWork, ...], choice: GateChoice,
            depth_nodes: tuple[int, ...] = ()) -> tuple[DecodeWork, ...]:
        """``decodes`` with the trees ``choice`` keeps cut to its depth (node budget and ``max_depth``), the others
        root only."""
        out = []
        for work, keep in zip(decodes, choice.keep):
            if not keep or choice.depth == 0:
                out.append(replace(work, node_budget=1) if work.node_budget > 1 else work)
                continue
            nodes, depth = self._shape(work.node_budget, work.max_depth, choice.depth, depth_nodes)
            out.append(replace(work, node_budget=nodes, max_depth=depth))
        return tuple(out)
