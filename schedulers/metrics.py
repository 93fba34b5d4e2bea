"""Prometheus metrics of the scheduler (prometheus-client), in a registry of their own.

Serve later at ``/metrics`` with ``prometheus_client.make_asgi_app(metrics.registry)`` (FastAPI ``mount``) or
render with :meth:`SchedulerMetrics.render`. Names use the ``specstream_scheduler_`` prefix; ``qos`` labels
take the values of :data:`~specstream.schedulers.plan.QOS_CLASSES`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specstream.schedulers.plan import QOS_CLASSES, StepPlan

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class SchedulerMetrics:
    """Queue depth and wait per class, batch size, tree nodes per step, tau, KV fraction, preemptions, rejections.

    Args:
        registry: where to register; a new :class:`CollectorRegistry` by default (so several schedulers, e.g. in
            tests and benchmarks, never collide in the global one).
        prefix: metric name prefix; two engines in one registry need different ones (the server exports the
            speech engine as ``specstream_scheduler_*`` and the caption engine as
            ``specstream_caption_scheduler_*``).
    """

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "specstream_scheduler_"):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = prefix
        self.queue_depth = Gauge(p + "queue_depth", "Requests queued (encode pending or waiting for a slot)",
                                 ["qos"], registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Arrival (or preemption) to (re)admission",
                                    ["qos"], buckets=_WAIT_BUCKETS, registry=r)
        self.batch_size = Histogram(p + "batch_size", "Requests in the target forward per step",
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.tree_nodes = Histogram(p + "tree_nodes_per_step", "Tree nodes + prefill tokens verified per step",
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.tau = Histogram(p + "tau", "Committed tokens per target step, per finished request", ["qos"],
                             buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10), registry=r)
        self.kv_fraction = Gauge(p + "kv_fraction", "Planned KV cache use / KV budget", registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted (KV freed, recomputed on resume)",
                                   ["qos"], registry=r)
        self.rejections = Counter(p + "rejections", "Requests refused by admission control", ["qos", "reason"],
                                  registry=r)
        for q in QOS_CLASSES:
            self.queue_depth.labels(q).set(0)

    def observe_step(self, plan: StepPlan, queue_depths: dict[str, int], kv_fraction: float) -> None:
        for q, n in queue_depths.items():
            self.queue_depth.labels(q).set(n)
        rows = len(plan.prefills) + len(plan.decodes)
        if rows:
            self.batch_size.observe(rows)
            self.tree_nodes.observe(plan.num_nodes)
        self.kv_fraction.set(kv_fraction)

    def render(self) -> bytes:
        """The text exposition format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)
