"""``specstream bench scheduler``: SLO attainment and throughput per QoS class of the QoS scheduler against the
FIFO scheduler and a static batcher, on the same seeded traces in the simulator.

Writes ``scheduler.md`` (a markdown table), ``scheduler.png`` (a plot) and ``scheduler.json`` (raw numbers)
into ``--out``. Figures come from the cost profile named by ``--profile`` (``h200-est`` is an estimate, not a
measurement; ``cpu-2core`` was measured on the 2-core CPU machine).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from specstream.pipeline.bench.harness import md_table, pyplot, save_figure, write_results
from specstream.schedulers.costmodel import get_profile
from specstream.schedulers.qos import QosConfig
from specstream.schedulers.simulator import SimConfig, simulate, summarize
from specstream.schedulers.traces import BATCH, INTERACTIVE, REALTIME, synthetic_trace

POLICIES = ("qos", "fifo", "static")


def workload(duration_s: float, scale: float, seed: int):
    """A mixed workload: subtitles (realtime), captioning (interactive), bulk video QA (batch). ``scale``
    multiplies every rate; 1.0 loads the ``h200-est`` profile near its capacity."""
    loads = [replace(REALTIME, rate_per_s=8.0 * scale, end_s=duration_s),
             replace(INTERACTIVE, rate_per_s=12.0 * scale, end_s=duration_s),
             replace(BATCH, rate_per_s=24.0 * scale, end_s=duration_s)]
    return synthetic_trace(loads, seed=seed)


def run(duration_s: float, scale: float, seed: int, profile: str) -> dict:
    events = workload(duration_s, scale, seed)
    tokens = {e.id: e.max_new_tokens for e in events}
    qos_cfg = QosConfig(num_slots=32, max_len=1024, token_budget=4096)
    out = {"profile": profile, "duration_s": duration_s, "scale": scale, "seed": seed, "requests": len(events),
           "policies": {}}
    for policy in POLICIES:
        cfg = SimConfig(policy=policy, scheduler=qos_cfg, cost=get_profile(profile), static_batch_size=16,
                        static_max_wait_s=0.05)
        res = simulate(events, cfg)
        summary = summarize(res)
        per = {}
        for q, c in summary["classes"].items():
            done = [r for r in res.records.values() if r.qos == q and r.finish_s is not None]
            per[q] = dict(c, tokens_per_s=round(sum(tokens[r.id] for r in done) / res.end_s, 2))
        per["_all"] = {"makespan_s": round(res.end_s, 3), "preemptions": summary["preemptions"],
                       "max_wait_ms": summary["max_wait_ms"], "peak_kv_fraction": summary["peak_kv_fraction"]}
        out["policies"][policy] = per
    return out


def table(result: dict) -> str:
    p = result["policies"]
    lines = [f"Profile `{result['profile']}`, {result['requests']} requests over {result['duration_s']} s "
             f"(load scale {result['scale']}, seed {result['seed']}).", ""]

    def ratio(a, b):  # an attainment of 0 against 0 is parity; above 0 against 0 has no finite ratio
        return "inf" if b == 0 and a > 0 else ("1.00" if b == 0 else f"{a / b:.2f}")

    lines += md_table(["qos", "policy", "completed", "rejected", "p50 ms", "p99 ms", "SLO attainment", "tokens/s",
                       "SLO vs fifo", "SLO vs static"],
                      [[q, policy, c["completed"], c["rejected"], f"{c['p50_ms']:.1f}", f"{c['p99_ms']:.1f}",
                        f"{c['slo_attainment']:.3f}", f"{c['tokens_per_s']:.1f}",
                        ratio(c["slo_attainment"], p["fifo"][q]["slo_attainment"]),
                        ratio(c["slo_attainment"], p["static"][q]["slo_attainment"])]
                       for q in ("realtime", "interactive", "batch") for policy in POLICIES
                       for c in (p[policy][q],)])
    lines.append("")
    lines += md_table(["policy", "makespan s", "preemptions", "max wait ms", "peak KV fraction"],
                      [[policy, f"{a['makespan_s']:.2f}", a["preemptions"], f"{a['max_wait_ms']:.1f}",
                        f"{a['peak_kv_fraction']:.3f}"] for policy in POLICIES for a in (p[policy]["_all"],)])
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    classes = ("realtime", "interactive", "batch")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.25
    for k, policy in enumerate(POLICIES):
        xs = [i + (k - 1) * width for i in range(len(classes))]
        axes[0].bar(xs, [result["policies"][policy][q]["slo_attainment"] for q in classes], width, label=policy)
        axes[1].bar(xs, [result["policies"][policy][q]["tokens_per_s"] for q in classes], width, label=policy)
    for ax, title in zip(axes, ("SLO attainment", "throughput (tokens/s)")):
        ax.set_xticks(range(len(classes)))
        ax.set_xticklabels(classes)
        ax.set_title(title)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend()
    fig.suptitle(f"scheduler policies, simulated on profile {result['profile']}")
    save_figure(fig, path, dpi=100)


def main(argv: list[str]) -> int:
    from specstream.helptext import doc_help

    ap = argparse.ArgumentParser(prog="specstream bench scheduler", description=doc_help(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals (default 20)")
    ap.add_argument("--scale", type=float, default=2.0, help="multiplies every arrival rate (2.0: overloaded)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival traces (default 0)")
    ap.add_argument("--profile", default="h200-est", help="cost profile: h200-est (estimated) or cpu-2core")
    args = ap.parse_args(argv)
    result = run(args.duration_s, args.scale, args.seed, args.profile)
    text = table(result)
    write_results(args.out, "scheduler", result, markdown=text, plot=plot, indent=1)
    print(text)
    return 0
