"""Captioning stages: keyframes (stage 1-2) and caption = vision encode + speculative decode (stage 3-4).

Both stages talk only through a :class:`~specstream.pipeline.broker.Broker`: the keyframe stage consumes
``specstream.requests`` and publishes :class:`FrameTask` s; the caption stage consumes them and publishes
:class:`~specstream.pipeline.messages.PipelineResult` s on ``specstream.results``. Vision encoding is
submitted through the engine's scheduler (``EncodeWork`` of modality ``"image"``), so encode batches and
decode steps are planned together.

Decoding uses the target VLM as verifier, a text-only draft LM (the prompt without its image tokens) and a
**temporal drafter** fed with the previous keyframe's caption of the same video, merged into one token tree.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import (
    InvalidRequestError,
    SpecstreamError,
    UnreadableSourceError,
    UnsupportedMediaError,
    UnsupportedTaskError,
)
from specstream.modalities.source import open_source
from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_REQUESTS, TOPIC_RESULTS, Broker, Message
from specstream.pipeline.messages import CaptionParams, ErrorInfo, PipelineRequest, PipelineResult
from specstream.schedulers.plan import EncodeItem, EncodeWork, Request

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_EXTS = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".gif", ".m4v"}
SERVED_TASKS = ("caption",)  # tasks the caption graph answers; others get an ``unsupported_task`` error result


@dataclass
class FrameTask:
    """A keyframe (or an image) to caption, or an input's error, on the frames topic.

    ``seq`` numbers the frame tasks of one request from 0 (it becomes the result's ``seq``); ``last`` marks the
    final message of a request; an ``error`` message carries no image.
    """

    request_id: str
    source: str
    kind: str
    params: CaptionParams
    qos: str = "interactive"
    frame_index: int = 0
    timestamp_s: float = 0.0
    scene_score: float = 1.0
    image: np.ndarray | None = None  # [H, W, 3] uint8 RGB
    error: ErrorInfo | None = None
    last: bool = False
    seq: int = 0


def media_kind(path: str) -> str:
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    raise UnsupportedMediaError(f"{path}: unsupported file type {ext or '(none)'!r} "
                                f"(images: {sorted(IMAGE_EXTS)}, videos: {sorted(VIDEO_EXTS)})")


def resolve_source(req: PipelineRequest, allowed_roots: list[Path] | None = None,
                   max_bytes: int = 512 * 1024 * 1024) -> tuple[str, str, str | None]:
    """(path on disk, display name, temp file to delete or None) of a request's source.

    Raises:
        UnreadableSourceError: outside the allowed roots, missing, too large, bad base64.
    """
    src = req.source
    if src.data_b64 is not None:
        try:
            data = base64.b64decode(src.data_b64, validate=True)
        except Exception:
            raise UnreadableSourceError("data_b64 is not valid base64") from None
        if len(data) > max_bytes:
            raise UnreadableSourceError(f"inline data of {len(data)} bytes exceeds the limit of {max_bytes}")
        suffix = Path(src.filename or "").suffix or ".bin"
        fd, tmp = tempfile.mkstemp(suffix=suffix, prefix="specstream-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return tmp, src.filename or f"inline:{req.id}", tmp
    uri = src.uri
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if "://" in path:
        raise UnreadableSourceError(f"unsupported source URI scheme: {uri!r} (use file:// or inline data)")
    real = Path(path).expanduser().resolve()
    if allowed_roots is not None and not any(real.is_relative_to(r.resolve()) for r in allowed_roots):
        raise UnreadableSourceError(f"{uri}: outside the allowed roots")
    if not real.exists():
        raise UnreadableSourceError(f"{uri}: no such file")
    if real.is_file() and real.stat().st_size > max_bytes:
        raise UnreadableSourceError(f"{uri}: {real.stat().st_size} bytes exceeds the limit of {max_bytes}")
    return str(real), uri if src.uri.startswith("file://") else path, None


def _next_keyframe(it) -> tuple[Any, Exception | None]:
    """The next keyframe of a `KeyframeRun` iterator (blocking): ``(keyframe, None)``, ``(None, None)`` at the
    end, or ``(None, error)`` for a typed media error (raised after the keyframes of the part that decoded)."""
    try:
        return next(it, None), None
    except SpecstreamError as exc:
        return None, exc


class KeyframeStage:
    """Stage 1-2: media in, keyframes (full resolution) out. Videos are decoded in killable child processes.

    Args:
        broker: the stage graph's broker.
        allowed_roots: directories ``file://`` sources must lie under (None: any path; the CLI's own inputs).
        concurrency: inputs decoded at once.
        max_source_bytes: size limit of a source (file or inline data), bytes.

    Each request message is acknowledged (``Message.done``) once all its frame tasks are published.
    """

    def __init__(self, broker: Broker, allowed_roots: list[Path] | None = None, concurrency: int = 2,
                 max_source_bytes: int = 512 * 1024 * 1024):
        self.broker = broker
        self.allowed_roots = allowed_roots
        self.max_source_bytes = max_source_bytes
        self.sem = asyncio.Semaphore(concurrency)
        self.frames_decoded = 0
        self.keyframes = 0

    async def run(self) -> None:
        tasks = set()
        async for msg in self.broker.subscribe(TOPIC_REQUESTS):
            await self.sem.acquire()
            task = asyncio.create_task(self._handle_message(msg))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), self.sem.release()))
        if tasks:
            await asyncio.gather(*tasks)

    async def _handle_message(self, msg: Message) -> None:
        req: PipelineRequest = msg.value
        try:
            if not msg.revoked:
                await self._handle(req)
        except Exception as exc:  # a bug or an environment failure: the request still gets its final answer
            await self._emit_error(req, req.source.uri or f"inline:{req.id}", CaptionParams(),
                                   SpecstreamError(f"{type(exc).__name__}: {exc}"))
        finally:
            msg.done()

    async def _emit_error(self, req: PipelineRequest, source: str, params, exc: SpecstreamError,
                          seq: int = 0) -> None:
        from specstream.modalities.source import name_fd_paths

        info = ErrorInfo(code=exc.code, message=name_fd_paths(exc.message, source))  # the source's name, not its fd
        await self.broker.publish(TOPIC_FRAMES, req.id, FrameTask(
            req.id, source, "unknown", params, req.qos, error=info, last=True, seq=seq))

    async def _handle(self, req: PipelineRequest) -> None:
        source = req.source.uri or req.source.filename or f"inline:{req.id}"
        if req.task not in SERVED_TASKS:
            await self._emit_error(req, source, CaptionParams(), UnsupportedTaskError(
                f"task {req.task!r} is not served by this worker (served: {', '.join(SERVED_TASKS)})"))
            return
        try:
            params = CaptionParams(**req.params)
        except Exception as exc:
            await self._emit_error(req, source, CaptionParams(), InvalidRequestError(f"bad params: {exc}"))
            return
        tmp = opened = None
        try:
            path, source, tmp = resolve_source(req, self.allowed_roots, self.max_source_bytes)
            kind = media_kind(req.source.filename or path)
            # the one open of the source (checked against the roots again, symlinks swapped in since refused):
            # everything below reads this descriptor, never the path
            opened = open_source(path, None if tmp else self.allowed_roots, self.max_source_bytes)
            path = opened.path
            if kind == "image":
                from specstream.modalities.image import load_image

                image = await asyncio.to_thread(load_image, path)
                self.frames_decoded += 1
                self.keyframes += 1
                await self.broker.publish(TOPIC_FRAMES, req.id, FrameTask(
                    req.id, source, "image", params, req.qos, 0, 0.0, 1.0, image, last=True))
                return
            n, error = await self._publish_keyframes(req, source, params, path)
            if error is not None:
                await self._emit_error(req, source, params, error, seq=n)
            elif not n:
                await self._emit_error(req, source, params, UnsupportedMediaError(f"{source}: no frames"))
        except SpecstreamError as exc:
            await self._emit_error(req, source, params, exc)
        finally:
            if opened is not None:
                opened.close()
            if tmp:
                os.unlink(tmp)


    async def _publish_keyframes(self, req: PipelineRequest, source: str, params, path: str
                                 ) -> tuple[int, Exception | None]:
        """Select ``path``'s keyframes and publish each as it is decoded (full resolution, one at a time: the
        frames topic's bound and the caption stage's window hold the rest back, so a long video never sits in
        memory). A frame is published once the next one (or the end) is known, to mark the last. Returns
        (frames published, the media error that ended the video or None)."""
        from specstream.stages.keyframes import select_keyframes

        cancel = threading.Event()
        run = select_keyframes(path, max_keyframes_per_minute=params.max_keyframes_per_minute, cancel=cancel)
        it = iter(run)
        busy = threading.Lock()  # held while a worker thread advances the run

        def step():
            with busy:
                return _next_keyframe(it)

        def close():
            with busy:  # after a running step returned: it stops within one frame once ``cancel`` is set
                it.close()  # ends the run's decoding child (a no-op after the last keyframe)

        pending, n, error = None, 0, None
        try:
            while True:
                kf, error = await asyncio.to_thread(step)
                if pending is not None:
                    await self.broker.publish(TOPIC_FRAMES, req.id, FrameTask(
                        req.id, source, "video", params, req.qos, pending.frame_index, float(pending.timestamp_s),
                        float(pending.scene_score), pending.image, last=kf is None and error is None, seq=n))
                    n += 1
                if kf is None:
                    break
                pending = kf
                self.keyframes += 1
        finally:
            # also on cancellation (Ctrl-C): a thread cannot be cancelled, so stop its decode loop and close the
            # run in a thread (the default executor, which asyncio.run waits for)
            cancel.set()
            await asyncio.to_thread(close)
            self.frames_decoded += run.stats.frames_decoded
        return n, error


@dataclass
class CaptionStats:
    captions: int = 0
    tokens: int = 0
    target_steps: int = 0
    decode_s: float = 0.0
    errors: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return self.tokens / self.target_steps if self.target_steps else 0.0


class Captioner:
    """The caption model set: target VLM, drafters, engine (QoS scheduler) and the image encoder.

    Args:
        target: LLaVA-family checkpoint (dir or hub id).
        drafts: draft checkpoints (text LMs, or VLMs whose language model drafts text-only).
        tree: draft tree shape (``TreeSpec``).
        temporal: draft from the previous keyframe's caption of the same video.
        visual_aware: smaller trees where the target attends strongly to the image.
        num_slots, max_len: engine sizes.
    """

    def __init__(self, target, drafts=(), tree=None, temporal: bool = True, ngram: bool = False,
                 visual_aware: bool = True, num_slots: int = 8, max_len: int = 1024, dtype: str = "float32",
                 device: str = "cpu", attention_maps: bool = False):
        from specstream.schedulers.qos import QosConfig, QosScheduler
        from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
        from specstream.stages.speculative.drafters.ngram import NgramDrafter
        from specstream.stages.speculative.drafters.temporal import TemporalDrafter
        from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
        from specstream.stages.speculative.models.loader import check_same_tokenizer, load_decoder, \
            resolve_checkpoint
        from specstream.stages.speculative.models.vlm import VisionLanguageModel

        tree = tree or TreeSpec()
        self.vlm = VisionLanguageModel(target, dtype, device)
        dec = self.vlm.decoder
        max_len = min(max_len, dec.config.max_position_embeddings)
        vocab_limit = min(len(self.vlm.tokenizer), dec.config.vocab_size)
        drafters = []
        self.temporal = TemporalDrafter(max_depth=tree.depth) if temporal else None
        if self.temporal is not None:
            drafters.append(self.temporal)
        for i, d in enumerate(drafts):
            ck = resolve_checkpoint(d)
            check_same_tokenizer(self.vlm.checkpoint, ck)
            drafters.append(ModelDrafter(load_decoder(ck, dtype, device), num_slots, max_len, tree,
                                         vocab_limit=vocab_limit, target_vocab=dec.config.vocab_size,
                                         name=f"draft{i}"))
        if ngram:
            drafters.append(NgramDrafter(max_depth=tree.depth))
        full = max(tree.num_nodes(), 9)
        scheduler = QosScheduler(QosConfig(num_slots=num_slots, max_len=max_len, reserved_realtime_slots=0,
                                           token_budget=max(4096, num_slots * (full + 1)),
                                           max_nodes_per_request=full, max_tree_depth=tree.depth))
        self.engine = SpeculativeEngine(dec, drafters, EngineConfig(num_slots=num_slots, max_len=max_len,
                                                                     tree=tree, max_nodes_per_request=full,
                                                                     visual_aware=visual_aware,
                                                                     # results are idempotent by (id, seq): a
                                                                     # redelivered frame must repeat its stats
                                                                     cost_aware=False),
                                        self.vlm.eos_token_ids, scheduler=scheduler)
        self.export_attention = attention_maps or visual_aware
        self.engine.executor.encoders["image"] = self._encode
        self._media: dict[str, tuple[str, Any]] = {}
        self._ids = itertools.count()

    def _encode(self, work: EncodeWork) -> None:
        """Encoder registry entry: one vision-tower batch for the work's images; stores prompt embeddings."""
        items = [(rid, self._media.pop(item.item_id)) for rid, item in work.items]
        feats = self.vlm.encode([prep for _, (_, prep) in items])
        for (rid, (_, prep)), f in zip(items, feats):
            self.engine.executor.prefix_embeds[rid] = self.vlm.prompt_embeds(prep, f)

    def make_request(self, prepared, max_new_tokens: int, qos: str = "interactive",
                     hypothesis: list[int] | None = None) -> Request:
        rid = f"cap-{next(self._ids)}"
        item = EncodeItem(f"{rid}/img", "image", 1.0)
        self._media[item.item_id] = (rid, prepared)
        span = None
        if self.export_attention and prepared.visual_positions:
            pos = prepared.visual_positions
            if pos[-1] - pos[0] + 1 == len(pos):
                span = (pos[0], pos[-1] + 1)
        return self.engine.make_request(prepared.input_ids, max_new_tokens, request_id=rid, qos=qos,
                                        encodes=(item,), draft_prompt_ids=prepared.draft_ids, visual_span=span,
                                        draft_hypothesis=tuple(hypothesis) if self.temporal is not None and hypothesis
                                        else None)

    def text(self, tokens: list[int]) -> str:
        eos = set(self.vlm.eos_token_ids)
        return self.vlm.decode_text([t for t in tokens if t not in eos]).strip()


class CaptionStage:
    """Stage 3-4: frames in, captions out (one :class:`PipelineResult` per frame; ``final`` on the last).

    Frames of one request are decoded in order, each drafted from the previous caption (temporal drafter);
    frames of different requests share the engine's continuous batch. A frame task is acknowledged
    (``Message.done``) once its result is published.

    Args:
        chain_store: where previous captions outlive the process (``get(request_id, seq)`` -> tokens or None,
            ``put(request_id, seq, tokens)``, both async), so a frame redelivered without its predecessor in
            memory drafts from the same hypothesis and repeats an identical result. None: memory only.
        max_in_flight: frames taken from the topic and not finished yet, at most (each holds its full-resolution
            image); the stage stops consuming until one finishes (backpressure on the frames topic).
    """

    def __init__(self, broker: Broker, captioner: Captioner, attention_maps: Path | None = None,
                 chain_store=None, max_in_flight: int = 8):
        from specstream.stages.decode import EngineDriver

        self.broker = broker
        self.captioner = captioner
        self.driver = EngineDriver(captioner.engine)
        self.attention_maps = attention_maps
        self.chain_store = chain_store
        self.stats = CaptionStats()
        self.max_in_flight = max(1, int(max_in_flight))
        self._chains: dict[str, tuple[asyncio.Task, int]] = {}  # request id -> (task of the newest frame, its seq)
        self._map_stems: dict[str, str] = {}  # source -> its attention maps' file-name stem (unique per source)

    async def run(self) -> None:
        self.driver.start()
        tasks = set()
        window = asyncio.Semaphore(self.max_in_flight)
        frames = self.broker.subscribe(TOPIC_FRAMES).__aiter__()
        try:
            while True:
                # a frame's predecessors were taken before it, so the oldest frames in flight can always finish
                await window.acquire()
                try:
                    msg = await frames.__anext__()
                except StopAsyncIteration:
                    break
                frame: FrameTask = msg.value
                prev = self._chains.get(frame.request_id)
                prev_task = prev[0] if prev is not None and prev[1] == frame.seq - 1 else None
                task = asyncio.create_task(self._handle_message(msg, frame, prev_task))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: window.release())
                self._chains[frame.request_id] = (task, frame.seq)
                if frame.last:
                    self._chains.pop(frame.request_id, None)
            await asyncio.gather(*tasks)
        finally:
            await self.driver.stop()

    async def _handle_message(self, msg: Message, frame: FrameTask, prev: asyncio.Task | None) -> list[int] | None:
        try:
            if prev is not None:
                hypothesis = await prev
            elif frame.seq > 0 and self.chain_store is not None:
                hypothesis = await self.chain_store.get(frame.request_id, frame.seq - 1)
            else:
                hypothesis = None
            if msg.revoked:
                return None
            tokens = await self._handle(frame, hypothesis, frame.seq)
            if tokens is not None and self.chain_store is not None and not frame.last:
                await self.chain_store.put(frame.request_id, frame.seq, tokens)
            return tokens
        finally:
            msg.done()

    def _map_stem(self, source: str) -> str:
        """A file-name stem for ``source``'s attention maps that no other source of this stage uses:
        ``clip`` for the first ``.../clip.*``, then ``clip-2``, ``clip-3``, ..."""
        from specstream.stages.attention_maps import map_stem

        if source not in self._map_stems:
            base = map_stem(source)
            taken = set(self._map_stems.values())
            stem, n = base, 1
            while stem in taken:
                n += 1
                stem = f"{base}-{n}"
            self._map_stems[source] = stem
        return self._map_stems[source]

    async def _handle(self, frame: FrameTask, hypothesis: list[int] | None, seq: int) -> list[int] | None:
        prepared = None
        if frame.error is None:
            try:
                prepared = await asyncio.to_thread(self.captioner.vlm.prepare, frame.image, frame.params.prompt)
            except Exception as exc:
                frame.error = ErrorInfo(code="corrupt_media", message=f"image preprocessing failed: {exc}")
        if frame.error is not None:
            self.stats.errors += 1
            await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
                id=frame.request_id, status="error", error=frame.error, seq=seq, final=frame.last))
            return hypothesis
        req = self.captioner.make_request(prepared, frame.params.max_new_tokens, frame.qos, hypothesis)
        t0 = time.perf_counter()
        try:
            done = await self.driver.submit(req)
        except SpecstreamError as exc:
            self.stats.errors += 1
            await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
                id=frame.request_id, status="error", error=ErrorInfo(**exc.to_dict()), seq=seq, final=frame.last))
            return hypothesis
        self.stats.decode_s += time.perf_counter() - t0
        vis = self.captioner.engine.visual_attention.pop(done.request_id, None)
        if done.error:
            self.stats.errors += 1
            await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
                id=frame.request_id, status="error", error=ErrorInfo(**done.error), seq=seq, final=frame.last))
            return hypothesis
        tokens = list(done.output_ids)
        caption = self.captioner.text(tokens)
        record = {"source": frame.source, "kind": frame.kind, "frame_index": frame.frame_index,
                  "timestamp_s": round(frame.timestamp_s, 6), "caption": caption, "tokens": tokens,
                  "scene_score": round(frame.scene_score, 6),
                  "stats": {"target_steps": done.stats.target_steps,
                            "mean_accepted": round(done.stats.mean_accepted, 6), "tau": round(done.stats.tau, 6)}}
        if self.attention_maps is not None and vis:
            from specstream.stages.attention_maps import save_attention_map

            path = save_attention_map(self.attention_maps, frame.source, frame.frame_index, frame.image,
                                      np.stack(vis), prepared.grid, stem=self._map_stem(frame.source))
            record["attention_map"] = str(path)
        self.stats.captions += 1
        self.stats.tokens += len(tokens)
        self.stats.target_steps += done.stats.target_steps
        await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
            id=frame.request_id, status="ok", output=record, seq=seq, final=frame.last))
        eos = set(self.captioner.vlm.eos_token_ids)
        return [t for t in tokens if t not in eos]
