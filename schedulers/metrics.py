"""Prometheus metrics of the scheduler (prometheus-client), in a registry of their own.

Serve later at ``/metrics`` with ``prometheus_client.make_asgi_app(metrics.registry)`` (FastAPI ``mount``) or
render with :meth:`SchedulerMetrics.render`. Names use the ``specstream_scheduler_`` prefix; ``model`` labels
name the device loop's model runners, ``qos`` labels take the values of
:data:`~specstream.schedulers.plan.QOS_CLASSES`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specstream.schedulers.plan import StepPlan

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class SchedulerMetrics:
    """Queue depth and wait per class, batch size, tree nodes per step, tau, KV fraction, preemptions, rejections,
    device seconds, prefill tokens and the prompt-prefix tokens reused.

    Args:
        registry: where to register; a new :class:`CollectorRegistry` by default (so several schedulers, e.g. in
            tests and benchmarks, never collide in the global one).
        prefix: metric name prefix (the device loop's one scheduler exports ``specstream_scheduler_*``).
    """

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "specstream_scheduler_"):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = prefix
        self.queue_depth = Gauge(p + "queue_depth", "Requests queued (encode pending or waiting for a slot)",
                                 ["model", "qos"], registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Arrival (or preemption) to (re)admission",
                                    ["model", "qos"], buckets=_WAIT_BUCKETS, registry=r)
        self.batch_size = Histogram(p + "batch_size", "Requests of a model in the step's forward", ["model"],
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.tree_nodes = Histogram(p + "tree_nodes_per_step", "Tree nodes + prefill tokens of a model per step",
                                    ["model"], buckets=_SIZE_BUCKETS, registry=r)
        self.tau = Histogram(p + "tau", "Committed tokens per target step, per finished request", ["model", "qos"],
                             buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10), registry=r)
        self.kv_fraction = Gauge(p + "kv_fraction", "Planned memory use (KV caches, encoder outputs) / budget",
                                 registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted (KV freed, recomputed on resume)",
                                   ["model", "qos"], registry=r)
        self.rejections = Counter(p + "rejections", "Requests refused by admission control",
                                  ["model", "qos", "reason"], registry=r)
        self.device_seconds = Counter(p + "device_seconds", "Seconds of device steps spent on each model's work "
                                      "(encoders, drafts, forwards)", ["model"], registry=r)
        self.prefill_tokens = Counter(p + "prefill_tokens", "Prompt tokens planned as prefill", ["model"], registry=r)
        self.prefix_reused_tokens = Counter(
            p + "prefix_reused_tokens", "Prompt tokens of a prefill whose keys/values the slot still held from its "
            "previous request (not run through the target again)", ["model"], registry=r)

    def observe_step(self, plan: StepPlan, queue_depths: dict[tuple[str, str], int], kv_fraction: float) -> None:
        """Book one plan: ``queue_depths`` per (model, qos)."""
        for (model, q), n in queue_depths.items():
            self.queue_depth.labels(model, q).set(n)
        rows: dict[str, int] = {}
        tokens: dict[str, int] = {}
        for p in plan.prefills:
            m = p.model
            rows[m] = rows.get(m, 0) + 1
            tokens[m] = tokens.get(m, 0) + p.num_tokens
        for d in plan.decodes:
            m = d.model
            rows[m] = rows.get(m, 0) + 1
            tokens[m] = tokens.get(m, 0) + d.node_budget
        for m, n in rows.items():
            self.batch_size.labels(m).observe(n)
            self.tree_nodes.labels(m).observe(tokens[m])
        self.kv_fraction.set(kv_fraction)

    def render(self) -> bytes:
        """The text exposition format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)
