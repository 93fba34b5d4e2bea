"""``specstream worker``: the caption graph's stages as Kafka consumer groups.

``--stages keyframes`` consumes requests (and live frame streams) and publishes frame tasks; ``--stages
caption`` consumes frame tasks (vision encode + speculative decode in one process: visual tokens never travel)
and publishes results; ``all`` runs both in one process (still two consumer groups). The process that consumes
requests also answers ``video_qa``, ``transcribe`` and ``generate`` requests itself (keyframes, transcription and
decoding in one process; one result per question). Kafka edges carry media
and text only: frame tasks carry PNG (lossless, the default) or JPEG bytes.

Bad input: a request message with a usable ``id`` gets a final error result (``schema_violation``,
``unsupported_task``, or the media codes); one without (not JSON, no id) goes to the DLQ topic with its
original bytes (the head of them when the copy would not fit ``max_message_bytes``) and
``dlq.reason``/``dlq.topic``/``dlq.partition``/``dlq.offset``/``dlq.sha256``/``dlq.original_bytes`` headers. A
frame task that cannot be decoded becomes its request's error result when its metadata header is readable.

Shutdown (SIGTERM/SIGINT): in-flight work gets ``drain_timeout_s`` to finish; what is left is cancelled,
stays uncommitted and is redelivered to the group; the process exits without waiting for it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
from pydantic import ValidationError

from specstream.errors import (
    BrokerUnreachableError,
    InvalidRequestError,
    SchemaViolationError,
    SpecstreamError,
    UnsupportedTaskError,
)
from specstream.pipeline import broker as topics
from specstream.pipeline.broker import Message
from specstream.pipeline.kafka import CaptionChainStore, Codec, KafkaBroker, KafkaSettings, StateStore
from specstream.pipeline.messages import (
    CaptionParams,
    ErrorInfo,
    GenerateParams,
    PipelineRequest,
    PipelineResult,
    QaParams,
    Task,
    TranscribeParams,
)

log = logging.getLogger("specstream.worker")

FRAME_META_HEADER = "specstream.frame"
PARAMS = {"caption": CaptionParams, "video_qa": QaParams, "transcribe": TranscribeParams, "generate": GenerateParams}
STAGE_EXIT_S = 5.0  # after a drain, how long stages may take to return before they are cancelled


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
        PARAMS[req.task](**req.params)
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
    from specstream.pipeline.caption_stages import FrameTask
    from specstream.pipeline.live import decode_image_bytes

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
        """Graceful: drain in-flight work (at most ``drain_timeout_s``), commit what finished, leave the groups.
        Work still in flight after the timeout is cancelled uncommitted (redelivered to the group). Returns
        True when everything in flight finished. Takes ``drain_timeout_s`` plus the time to commit and leave."""
        drained = await self.broker.drain()
        if not drained:
            for task in self.tasks:
                task.cancel()
        # drained stages end on their own (their subscriptions ended, nothing is in flight)
        _, late = await asyncio.wait(self.tasks, timeout=STAGE_EXIT_S) if self.tasks else (set(), set())
        for task in late:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.broker.close()
        await self._stop_loops()
        return drained

    async def _stop_loops(self) -> None:
        """Stop the device loops the stages ran in (each once; a stopped loop's thread has exited)."""
        loops = []
        qa = self.stages.get("qa")
        if qa is not None and qa.hub._loop is not None:
            loops.append(qa.hub.loop)
        cap = self.stages.get("caption")
        if cap is not None:
            loops.append(cap.loop)
        for lp in {id(lp): lp for lp in loops}.values():
            await asyncio.to_thread(lp.stop, 30.0)


async def start_worker(settings: KafkaSettings, captioner=None) -> Worker:
    """Create topics, join the groups and start the stages of ``settings.stages``.

    Args:
        captioner: a ready :class:`~specstream.stages.caption.Captioner` (default: built from the settings).
    """
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

    async def bad_frame_task(msg: Message, exc: Exception) -> None:
        try:
            meta = json.loads(msg.headers[FRAME_META_HEADER])
            rid, seq, last = str(meta["request_id"]), int(meta["seq"]), bool(meta["last"])
        except Exception:
            await broker.dead_letter(msg, f"undecodable frame task: {exc}")
            return
        await broker.publish(topics.TOPIC_RESULTS, rid, PipelineResult(
            id=rid, status="error", error=ErrorInfo(code="corrupt_media", message=f"undecodable frame task: {exc}"),
            seq=seq, final=last))

    broker.on_bad[topics.TOPIC_REQUESTS] = bad_request
    broker.on_bad[topics.TOPIC_FRAMES] = bad_frame_task
    worker = Worker(s, broker)
    await _connect(broker, topic_specs(s))  # an unreachable broker fails now, not after the models loaded
    try:
        if run_cap and captioner is None:
            captioner = await asyncio.to_thread(_build_captioner, s, TreeSpec)
        await _start_stages(worker, broker, store, captioner, run_kf, run_cap)
    except BaseException:
        await broker.close()
        raise
    return worker


async def _connect(broker: KafkaBroker, specs: list[tuple[str, dict[str, str]]]) -> None:
    """First contact: create the topics, start the producer. Raises :class:`BrokerUnreachableError` (one line,
    naming the address) when no broker answers; aiokafka's own connection errors are not logged meanwhile."""
    from aiokafka.errors import KafkaConnectionError

    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL + 1)
    try:
        await broker.connect(specs)
    except KafkaConnectionError:
        raise BrokerUnreachableError(f"cannot reach the Kafka broker at {broker.settings.bootstrap} "
                                     "(check --broker / SPECSTREAM_KAFKA_BOOTSTRAP)") from None
    finally:
        quiet.setLevel(level)


async def _start_stages(worker: Worker, broker: KafkaBroker, store: StateStore, captioner, run_kf: bool,
                        run_cap: bool) -> None:
    from specstream.pipeline.routing import TaskRouter
    from specstream.pipeline.caption_stages import CaptionStage, KeyframeStage
    from specstream.pipeline.live import LiveKeyframeStage
    from specstream.pipeline.qa_stage import QA_TASKS, QaStage

    s = worker.settings
    live = None
    if run_kf:
        live = LiveKeyframeStage(broker, store, topics.TOPIC_LIVE_FRAMES, dead_letter=broker.dead_letter)
        # the requests topic carries captions (keyframe stage) and video_qa / transcribe / generate (QA stage)
        router = TaskRouter(broker)
        worker.stages["keyframes"] = KeyframeStage(router.view("caption"), s.allowed_roots or None,
                                                   max_source_bytes=s.max_source_bytes)
        worker.stages["qa"] = QaStage(router.view("qa", QA_TASKS), _build_hub(s, captioner), s.allowed_roots or None,
                                      max_source_bytes=s.max_source_bytes)
        worker.stages["router"] = router
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


def _build_captioner(s: KafkaSettings, TreeSpec):
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, drafts = s.target, list(s.draft)
    if target is None:
        target, default_draft = default_caption_models()
        drafts = drafts or [str(default_draft)]
    return Captioner(target, drafts, TreeSpec(), num_slots=s.num_slots, dtype=s.dtype, device=s.device)


def _build_hub(s: KafkaSettings, captioner=None):
    """The QA stage's models (loaded on the first request that needs each). With a captioner (``stages=all``) the
    hub serves that VLM runner in the captioner's device loop: one copy of the model, one loop per device."""
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.serving import HubConfig, ModelHub

    target, drafts, name = s.target, tuple(s.draft), None
    if target is None:
        t, d = default_caption_models(quiet=True)
        target, drafts, name = str(t), drafts or (str(d),), "specstream-tiny-llava"
    return ModelHub(HubConfig(vlm=target, vlm_drafts=drafts, vlm_name=name, text_model=s.text_model,
                              text_drafts=tuple(s.text_draft), speech_model=s.speech_model, clip_model=s.clip_model,
                              clip_pretrained=s.clip_pretrained, num_slots=s.num_slots, dtype=s.dtype,
                              draft_dtype=s.draft_dtype, device=s.device),
                    loop=captioner.loop if captioner is not None else None, captioner=captioner)


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
    from specstream.helptext import doc_help

    p = argparse.ArgumentParser(prog="specstream worker", description=doc_help(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", help="kafka://HOST:PORT[,HOST:PORT] (env SPECSTREAM_KAFKA_BOOTSTRAP)")
    p.add_argument("--group", help="consumer group prefix (env SPECSTREAM_KAFKA_GROUP; default specstream)")
    p.add_argument("--stages", choices=["keyframes", "caption", "all"], help="stages to run (default all)")
    p.add_argument("--allowed-root", action="append", dest="allowed_roots",
                   help="file:// sources must lie under this directory (repeatable; env SPECSTREAM_KAFKA_ALLOWED_ROOTS, "
                        "a JSON list)")
    p.add_argument("--target", help="VLM checkpoint for the caption stage (default: built-in tiny model)")
    p.add_argument("--draft", action="append", help="draft checkpoint (repeatable)")
    p.add_argument("--text-model", help="text model for video_qa answer_with=text and generate model=text")
    p.add_argument("--text-draft", action="append", help="draft of --text-model (repeatable)")
    p.add_argument("--speech-model", help="Whisper checkpoint for video_qa and transcribe (default: tiny.en)")
    p.add_argument("--clip-model", help="open_clip architecture or model-config JSON: video_qa frames by similarity")
    p.add_argument("--clip-pretrained", help="local weights file of --clip-model")
    p.add_argument("--max-in-flight", type=int, help="messages in flight per stage before its partitions pause "
                                                     "(env SPECSTREAM_KAFKA_MAX_IN_FLIGHT; default 8)")
    p.add_argument("--max-poll-interval-ms", type=int,
                   help="Kafka's max.poll.interval.ms of the consumers (env SPECSTREAM_KAFKA_MAX_POLL_INTERVAL_MS; "
                        "default 300000)")
    p.add_argument("--partitions", type=int, help="partitions of the topics the worker creates")
    p.add_argument("--frame-format", choices=["png", "jpeg"],
                   help="keyframes on the frame-task topic (env SPECSTREAM_KAFKA_FRAME_FORMAT; default png, lossless)")
    p.add_argument("--log-level", default="INFO", help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")
    return p


def settings_from_args(args: argparse.Namespace) -> KafkaSettings:
    """The worker's settings: flags over ``SPECSTREAM_KAFKA_*`` variables over defaults.

    Raises:
        InvalidRequestError: a bad flag or variable (the message names both).
    """
    over = {k: v for k, v in vars(args).items() if v is not None and k not in ("broker", "log_level")}
    if args.broker is not None:
        if not args.broker.startswith("kafka://"):
            raise InvalidRequestError(f"--broker must be kafka://HOST:PORT, got {args.broker!r}")
        over["bootstrap"] = args.broker
    try:
        return KafkaSettings(**over)
    except ValidationError as exc:
        flags = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
        flags["bootstrap"] = "--broker"
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            where = " / ".join(x for x in (flags.get(name), f"SPECSTREAM_KAFKA_{name.upper()}") if x)
            problems.append(f"{name} ({where}): {err['msg']}")
        raise InvalidRequestError("; ".join(problems)) from None


def worker_main(argv: list[str]) -> int:
    """Entry point of ``specstream worker``. Errors (bad settings, an unreachable broker) raise
    :class:`SpecstreamError`; the CLI prints them as one line and exits 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    settings = settings_from_args(args)
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(run_worker(settings))
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # unlike asyncio.run, does not wait for the default executor's threads
    _exit_past_stragglers(code)
    return code


def _exit_past_stragglers(code: int) -> None:
    """Exit now when a worker thread still runs work abandoned at the drain timeout (an engine step, a decode
    step): its message is uncommitted and will be redelivered, and waiting for it would overrun the timeout
    (the interpreter joins such threads at exit)."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for t in others:
        t.join(timeout=0.5)  # idle pool threads end at once
    busy = [t.name for t in others if t.is_alive()]
    if busy:
        log.warning("exiting without waiting for %d busy thread%s (%s)", len(busy), "" if len(busy) == 1 else "s",
                    ", ".join(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
