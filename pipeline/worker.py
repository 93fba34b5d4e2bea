"""``specstream worker``: the caption graph's stages as Kafka consumer groups.

``--stages keyframes`` consumes requests (and live frame streams) and publishes frame tasks; ``--stages
caption`` consumes frame tasks (vision encode + speculative decode in one process: visual tokens never travel)
and publishes results; ``all`` runs both in one process (still two consumer groups). Kafka edges carry media
and text only: frame tasks carry PNG (lossless, the default) or JPEG bytes.

Bad input: a request message with a usable ``id`` gets a final error result (``schema_violation``,
``unsupported_task``, or the media codes); one without (not JSON, no id) goes to the DLQ topic with its
original bytes and ``dlq.reason``/``dlq.topic``/``dlq.partition``/``dlq.offset`` headers.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
from pydantic import ValidationError

from specstream.errors import SchemaViolationError, SpecstreamError, UnsupportedTaskError
from specstream.pipeline import broker as topics
from specstream.pipeline.broker import Message
from specstream.pipeline.kafka import CaptionChainStore, Codec, KafkaBroker, KafkaSettings, StateStore
from specstream.pipeline.messages import CaptionParams, ErrorInfo, PipelineRequest, PipelineResult, Task

log = logging.getLogger("specstream.worker")

FRAME_META_HEADER = "specstream.frame"


class BadRequest(ValueError):
    """A request message that cannot be served; ``request_id`` is None when the message has no usable id."""

    def __init__(self, request_id: str | None, error: SpecstreamError | None, reason: str):
        super().__init__(reason)
        self.request_id = request_id
        self.error = error


def usable_id(obj: Any) -> str | None:
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= 256 else None


def decode_request(data: bytes | None, headers: dict[str, str]) -> PipelineRequest:
    """JSON bytes -> :class:`PipelineRequest`. Raises :class:`BadRequest`."""
    try:
        obj = json.loads(data or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(None, None, f"not JSON: {exc}") from None
    rid = usable_id(obj)
    if rid is None:
        raise BadRequest(None, None, "no usable 'id' (a string of 1-256 characters)")
    task = obj.get("task", "caption")
    if isinstance(task, str) and task not in get_args(Task):
        raise BadRequest(rid, UnsupportedTaskError(f"unknown task {task!r} (known: {', '.join(get_args(Task))})"),
                         "unsupported task")
    try:
        req = PipelineRequest.model_validate(obj)
        if req.task == "caption":
            CaptionParams(**req.params)
    except (ValidationError, TypeError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(rid, SchemaViolationError(f"{where or 'request'}: {first['msg']}"), "schema") from None
    return req


def encode_json_model(model) -> tuple[bytes, dict[str, str]]:
    return model.model_dump_json().encode(), {}


def encode_image(image: np.ndarray, fmt: str, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    else:
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def frame_task_codec(settings: KafkaSettings) -> Codec:
    """FrameTask <-> (encoded image bytes, JSON metadata header)."""
    from specstream.stages.caption import FrameTask
    from specstream.stages.live import decode_image_bytes

    def encode(t: FrameTask) -> tuple[bytes | None, dict[str, str]]:
        meta = {"request_id": t.request_id, "source": t.source, "kind": t.kind, "params": t.params.model_dump(),
                "qos": t.qos, "frame_index": t.frame_index, "timestamp_s": t.timestamp_s,
                "scene_score": t.scene_score, "last": t.last, "seq": t.seq,
                "error": t.error.model_dump() if t.error else None}
        data = None if t.image is None else encode_image(t.image, settings.frame_format, settings.jpeg_quality)
        return data, {FRAME_META_HEADER: json.dumps(meta)}

    def decode(data: bytes | None, headers: dict[str, str]) -> FrameTask:
        m = json.loads(headers[FRAME_META_HEADER])
        return FrameTask(m["request_id"], m["source"], m["kind"], CaptionParams(**m["params"]), m["qos"],
                         m["frame_index"], m["timestamp_s"], m["scene_score"],
                         decode_image_bytes(data) if data else None,
                         ErrorInfo(**m["error"]) if m["error"] else None, m["last"], m["seq"])

    return Codec(encode, decode)


def codecs(settings: KafkaSettings) -> dict[str, Codec]:
    """Codecs of the stage graph's topics (live frames stay bytes: the live stage decodes them)."""
    return {
        topics.TOPIC_REQUESTS: Codec(encode_json_model, decode_request),
        topics.TOPIC_FRAMES: frame_task_codec(settings),
        topics.TOPIC_RESULTS: Codec(encode_json_model, lambda b, h: PipelineResult.model_validate_json(b or b"")),
    }


def topic_names(settings: KafkaSettings) -> dict[str, str]:
    """The stage graph's topic names -> the configured names on Kafka."""
    return {topics.TOPIC_REQUESTS: settings.topic_requests, topics.TOPIC_FRAMES: settings.topic_frame_tasks,
            topics.TOPIC_RESULTS: settings.topic_results, topics.TOPIC_LIVE_FRAMES: settings.topic_frames}


def topic_specs(settings: KafkaSettings) -> list[tuple[str, dict[str, str]]]:
    """Every topic the worker uses, with its configs (created explicitly; auto-creation is not relied on)."""
    big = {"max.message.bytes": str(settings.max_message_bytes)}
    return [
        (settings.topic_requests, big), (settings.topic_frames, big), (settings.topic_frame_tasks, big),
        (settings.topic_results, {}), (settings.topic_dlq, big),
        (settings.topic_state, {"cleanup.policy": "compact,delete",
                                "retention.ms": str(settings.state_retention_ms)}),
    ]


@dataclass
class Worker:
    """A running worker: its broker and stages (``stats`` for tests and the benchmark)."""

    settings: KafkaSettings
    broker: KafkaBroker
    tasks: list[asyncio.Task] = field(default_factory=list)
    stages: dict[str, Any] = field(default_factory=dict)

    async def stop(self) -> bool:
        """Graceful: drain in-flight work, commit, leave the groups. True when everything in flight finished."""
        drained = await self.broker.drain()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.broker.close()
        return drained


async def start_worker(settings: KafkaSettings, captioner=None) -> Worker:
    """Create topics, join the groups and start the stages of ``settings.stages``.

    Args:
        captioner: a ready :class:`~specstream.stages.caption.Captioner` (default: built from the settings).
    """
    from specstream.stages.caption import Captioner, CaptionStage, KeyframeStage
    from specstream.stages.live import LiveKeyframeStage
    from specstream.stages.speculative.drafters.model import TreeSpec

    s = settings
    run_kf = s.stages in ("keyframes", "all")
    run_cap = s.stages in ("caption", "all")
    groups = {}
    if run_kf:
        groups[f"{s.group}.keyframes"] = [s.topic_requests, s.topic_frames]
    if run_cap:
        groups[f"{s.group}.caption"] = [s.topic_frame_tasks]
    broker = KafkaBroker(s, groups, codecs(s), topic_names=topic_names(s))
    store = StateStore(broker, s.topic_state)

    async def bad_request(msg: Message, exc: Exception) -> None:
        if isinstance(exc, BadRequest) and exc.request_id is not None:
            await broker.publish(topics.TOPIC_RESULTS, exc.request_id, PipelineResult(
                id=exc.request_id, status="error", error=ErrorInfo(**exc.error.to_dict()), seq=0, final=True))
        else:
            await broker.dead_letter(msg, str(exc))

    broker.on_bad[topics.TOPIC_REQUESTS] = bad_request
    worker = Worker(s, broker)
    if run_cap and captioner is None:
        captioner = await asyncio.to_thread(_build_captioner, s, TreeSpec)
    live = None
    if run_kf:
        live = LiveKeyframeStage(broker, store, topics.TOPIC_LIVE_FRAMES, dead_letter=broker.dead_letter)
        worker.stages["keyframes"] = KeyframeStage(broker, s.allowed_roots or None, max_source_bytes=s.max_source_bytes)
        worker.stages["live"] = live
        g = broker.group_of(topics.TOPIC_REQUESTS)

        async def kf_assigned(tps):
            if any(t == s.topic_frames for t, _ in tps):
                await store.load()

        async def kf_revoked(tps):
            live.forget_partitions({p for t, p in tps if t == s.topic_frames})

        g.on_assigned.append(kf_assigned)
        g.on_revoked.append(kf_revoked)
    if run_cap:
        worker.stages["caption"] = CaptionStage(broker, captioner, chain_store=CaptionChainStore(store))

        async def cap_assigned(tps):
            if tps:
                await store.load()

        broker.group_of(topics.TOPIC_FRAMES).on_assigned.append(cap_assigned)
    await broker.start(topic_specs(s))
    for name, stage in worker.stages.items():
        worker.tasks.append(asyncio.create_task(stage.run(), name=f"stage-{name}"))
    return worker


def _build_captioner(s: KafkaSettings, TreeSpec):
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, drafts = s.target, list(s.draft)
    if target is None:
        target, default_draft = default_caption_models()
        drafts = drafts or [str(default_draft)]
    return Captioner(target, drafts, TreeSpec(), num_slots=s.num_slots, dtype=s.dtype, device=s.device)


async def run_worker(settings: KafkaSettings, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or ``stop``), then drain and commit. Returns the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = await start_worker(settings)
    print(f"specstream worker: stages={settings.stages} group={settings.group} broker={settings.bootstrap}",
          file=sys.stderr, flush=True)
    await stop.wait()
    print("specstream worker: draining", file=sys.stderr, flush=True)
    drained = await worker.stop()
    print("specstream worker: stopped" + ("" if drained else " (drain timed out)"), file=sys.stderr, flush=True)
    return 0 if drained else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specstream worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", help="kafka://HOST:PORT[,HOST:PORT] (env SPECSTREAM_KAFKA_BOOTSTRAP)")
    p.add_argument("--group", help="consumer group prefix (env SPECSTREAM_KAFKA_GROUP; default specstream)")
    p.add_argument("--stages", choices=["keyframes", "caption", "all"], help="stages to run (default all)")
    p.add_argument("--allowed-root", action="append", dest="allowed_roots",
                   help="file:// sources must lie under this directory (repeatable; env: JSON list)")
    p.add_argument("--target", help="VLM checkpoint for the caption stage (default: built-in tiny model)")
    p.add_argument("--draft", action="append", help="draft checkpoint (repeatable)")
    p.add_argument("--max-in-flight", type=int)
    p.add_argument("--max-poll-interval-ms", type=int)
    p.add_argument("--partitions", type=int, help="partitions of the topics the worker creates")
    p.add_argument("--frame-format", choices=["png", "jpeg"])
    p.add_argument("--log-level", default="INFO")
    return p


def settings_from_args(args: argparse.Namespace) -> KafkaSettings:
    over = {k: v for k, v in vars(args).items() if v is not None and k not in ("broker", "log_level")}
    if args.broker is not None:
        if not args.broker.startswith("kafka://"):
            raise SpecstreamError(f"--broker must be kafka://HOST:PORT, got {args.broker!r}")
        over["bootstrap"] = args.broker
    return KafkaSettings(**over)


def worker_main(argv: list[str]) -> int:
    """Entry point of ``specstream worker``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    settings = settings_from_args(args)
    return asyncio.run(run_worker(settings))
