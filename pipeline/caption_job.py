"""``specstream caption``: local files captioned by the stages directly, written to JSONL.

:func:`caption_files` is the command line's path (and ``specstream.caption``'s): each input is opened, its frames
read (:class:`~specstream.stages.caption.FrameReader`) and each frame captioned on the device loop
(:func:`~specstream.stages.caption.caption_frame`), plain calls with no broker between them. :func:`run_caption_graph`
runs the same stages as broker consumers (requests -> KeyframeStage -> frames -> CaptionStage -> results), as the
Kafka worker does; the HTTP caption route runs it on the in-process broker. Both give the same records.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specstream.errors import MediaError, UnreadableSourceError, UnsupportedMediaError, error_dict
from specstream.modalities.source import open_source
from specstream.stages.caption import (
    IMAGE_EXTS,
    MAX_SOURCE_BYTES,
    VIDEO_EXTS,
    Captioner,
    CaptionStats,
    FrameReader,
    MapStems,
    caption_frame,
    media_kind,
    sniff_media,
)

# full-resolution keyframes waiting between the keyframe and caption stages of the broker graph, at most; with the
# caption stage's window (CaptionStage.max_in_flight) and one pending frame per video being decoded, this bounds
# the frames alive
FRAMES_TOPIC_BOUND = 4


@dataclass
class CaptionJobSummary:
    """Counts of one caption job. ``inputs`` counts the files captioned or failed; ``skipped`` the files of the
    given directories that are neither images nor videos (each named on stderr; they are not inputs)."""

    inputs: int = 0
    failed_inputs: int = 0
    skipped: int = 0
    frames_decoded: int = 0
    keyframes: int = 0
    captions: int = 0
    tokens: int = 0
    target_steps: int = 0
    seconds: float = 0.0
    records: list[dict] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.tokens / self.target_steps if self.target_steps else 0.0

    def line(self) -> str:
        """One line for people: counts (singular for one), time, tokens/s and tau (tokens per target step)."""
        tps = self.tokens / self.seconds if self.seconds else 0.0
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        head = f"{count(self.inputs, 'input')} ({self.failed_inputs} failed{skipped}): "
        if not self.captions:
            # Nothing was decoded (every input failed, or none had a keyframe): a rate of 0.0 tokens/s would
            # read as a speed measurement; say that nothing was captioned instead.
            return (head + f"{count(self.frames_decoded, 'frame')} decoded, {count(self.keyframes, 'keyframe')}, "
                    f"no caption written in {self.seconds:.1f} s")
        return (head + f"{count(self.frames_decoded, 'frame')} decoded, {count(self.keyframes, 'keyframe')}, "
                f"{count(self.captions, 'caption')}, {count(self.tokens, 'token')} in {self.seconds:.1f} s "
                f"({tps:.1f} tokens/s), tau {self.tau:.2f}")


def count(n: int, noun: str) -> str:
    """``"1 input"``, ``"2 inputs"``, ``"0 inputs"`` (English plural with -s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def expand_inputs(inputs: list[str]) -> tuple[list[str], list[str]]:
    """``(files, skipped)``: files as given; directories expanded to their media files, sorted: files with an
    image or video extension, and files without one whose content is an image or a video (``sniff_media``).
    ``skipped``: the other files of those directories, sorted (a given file is never skipped: it gets its error
    record). Missing paths stay in ``files`` (they fail)."""
    files, skipped = [], []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file():
                    media = f.suffix.lower() in IMAGE_EXTS | VIDEO_EXTS or sniff_media(str(f)) is not None
                    (files if media else skipped).append(str(f))
        else:
            files.append(item)
    return files, skipped


def check_input(path: str) -> None:
    """The checks of one command-line input that need no model: a regular, readable, non-empty file whose content
    or extension is an image or a video (``media_kind``). The caption graph makes the same checks; running them
    first lets a job whose inputs all fail end before any model loads.

    Raises:
        UnreadableSourceError: missing, a directory, no permission, empty (0 bytes).
        UnsupportedMediaError: neither an image nor a video.
    """
    with open_source(path) as opened:
        if opened.size == 0:
            raise UnreadableSourceError(f"file is empty (0 bytes): {path}")
        media_kind(opened.path, path)


def error_record(source: str, error) -> dict:
    """The JSONL record of a failed input: ``{"source", "error": {"code", "message"}}`` (``error``: that dict or
    an ``ErrorInfo``)."""
    return {"source": source, "error": dict(error) if isinstance(error, dict) else error.model_dump()}


def failure_line(record: dict) -> str:
    """The stderr line naming a failed input and why: ``failed SOURCE [code]: message``."""
    return f"failed {record['source']} [{record['error']['code']}]: {record['error']['message']}"


async def caption_files(inputs: list[str], captioner: Captioner, out, prompt: str, max_new_tokens: int,
                        max_keyframes_per_minute: float | None, attention_maps: Path | None,
                        qos: str = "batch", progress=None, max_in_flight: int = 8, concurrency: int = 2,
                        failed_early: dict[int, dict] | None = None, report=None,
                        schema: dict | None = None) -> CaptionJobSummary:
    """Caption local files with the stages directly; write one JSON line per caption / failed input to ``out``,
    inputs in input order and each input's records in frame order, each as soon as it and those before it are
    done (a long video's captions appear while it is still being captioned, and survive an interrupt).

    ``concurrency`` inputs are decoded at once; ``max_in_flight`` frames are being captioned at once (they share
    the engine's continuous batch), each holding its full-resolution image: with one pending frame per input being
    decoded, this bounds the frames in memory whatever the videos' length. A video's frames are captioned in
    order, each drafted from the previous caption (temporal drafter). ``failed_early``: input index -> the
    ``{"code", "message"}`` it already failed with (``check_input``); its record is written in its place.
    ``report``: called with the stderr line of each failed input (``failure_line``) as its record is written.
    ``schema``: a JSON Schema every caption follows. Cancelling this cancels the inputs' decoding and their
    requests in the device loop."""
    from specstream.modalities.source import name_fd_paths

    failed_early = failed_early or {}
    summary = CaptionJobSummary(inputs=len(inputs))
    stats = CaptionStats()
    readers: list[FrameReader] = []
    window = asyncio.Semaphore(max(1, int(max_in_flight)))
    decoding = asyncio.Semaphore(max(1, int(concurrency)))
    stems = MapStems()
    tasks: set[asyncio.Task] = set()
    captioner.loop.start()  # the device loop's thread (idempotent)

    async def caption(frame, prev: asyncio.Task | None, source: str):
        hypothesis = None
        if prev is not None:  # the previous caption of the video (drafting only)
            await asyncio.wait([prev])
            if not prev.cancelled() and prev.exception() is None:
                hypothesis = prev.result()[1]
        try:
            fc = await caption_frame(captioner, frame, prompt, max_new_tokens, qos, hypothesis, schema,
                                     attention_maps, stems)
        except Exception as exc:  # every failure ends as the frame's error record; the next drafts from before
            stats.errors += 1
            return error_record(source, error_dict(exc)), hypothesis
        stats.decode_s += fc.decode_s
        stats.captions += 1
        stats.tokens += len(fc.tokens)
        stats.target_steps += fc.target_steps
        return fc.record, fc.draft

    def spawn(coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def read_input(i: int, path: str, q: asyncio.Queue) -> None:
        opened = None
        prev = None
        try:
            if i in failed_early:
                q.put_nowait(error_record(path, failed_early[i]))
                return
            async with decoding:
                try:
                    opened = open_source(path, None, MAX_SOURCE_BYTES)
                    kind = await asyncio.to_thread(media_kind, opened.path, path)
                    reader = FrameReader(opened.path, path, kind, max_keyframes_per_minute)
                    readers.append(reader)
                    async with reader:
                        async for frame in reader:
                            await window.acquire()
                            prev = spawn(caption(frame, prev, path))
                            prev.add_done_callback(lambda _: window.release())
                            q.put_nowait(prev)
                    if reader.keyframes == 0:
                        raise UnsupportedMediaError(f"{path}: no frames")
                except Exception as exc:  # the input's error, after the frames read before it
                    info = error_dict(exc)
                    info["message"] = name_fd_paths(info["message"], path)  # its name, not its descriptor
                    q.put_nowait(error_record(path, info))
                finally:
                    if opened is not None:
                        opened.close()
        finally:
            q.put_nowait(None)

    t0 = time.perf_counter()
    queues = [asyncio.Queue() for _ in inputs]  # per input: caption tasks and records in order, then None
    try:
        for i, path in enumerate(inputs):
            spawn(read_input(i, path, queues[i]))
        failed = 0
        for i, q in enumerate(queues):
            input_failed = False
            while (item := await q.get()) is not None:
                rec = (await item)[0] if isinstance(item, asyncio.Task) else item
                out.write(json.dumps(rec) + "\n")
                out.flush()
                summary.records.append(rec)
                if "error" in rec:
                    input_failed = True
                    if report is not None:
                        report(failure_line(rec))
                if progress is not None:
                    progress.set_postfix(captions=stats.captions, failed=failed + input_failed, refresh=False)
                    progress.update(0)
            failed += input_failed
            if progress is not None:
                progress.set_postfix(captions=stats.captions, failed=failed, refresh=False)
                progress.update(1)
    finally:
        for task in list(tasks):  # cancelled (Ctrl-C, a closed iterator): the loop cancels their requests
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    summary.seconds = time.perf_counter() - t0
    summary.failed_inputs = failed
    summary.frames_decoded = sum(r.frames_decoded for r in readers)
    summary.keyframes = sum(r.keyframes for r in readers)
    summary.captions = stats.captions
    summary.tokens = stats.tokens
    summary.target_steps = stats.target_steps
    return summary


async def run_caption_graph(inputs: list[str], captioner: Captioner, out, prompt: str, max_new_tokens: int,
                            max_keyframes_per_minute: float | None, attention_maps: Path | None,
                            qos: str = "batch", progress=None, broker: InProcessBroker | None = None,
                            max_in_flight: int = 8, allowed_roots: list[Path] | None = None,
                            failed_early: dict[int, dict] | None = None, report=None,
                            schema: dict | None = None) -> CaptionJobSummary:
    """Run the graph over ``inputs``; write one JSON line per caption / failed input to ``out``.

    ``broker``: the in-process broker to run on (default: one whose frames topic holds ``FRAMES_TOPIC_BOUND``
    frames); ``max_in_flight``: the caption stage's window. Together they bound the full-resolution frames in
    memory, whatever the videos' length (backpressure back to the decoding child). ``allowed_roots``: directories
    the inputs must lie in, checked when each is opened (None: any path; the command line's own inputs).
    ``failed_early``: input index -> the ``{"code", "message"}`` it already failed with (``check_input``); those
    inputs are not sent through the graph, their records are written in their place. ``report``: called with the stderr line
    of each failed input (``failure_line``) as its record is written (None: not reported). ``schema``: a JSON
    Schema every caption follows (``CaptionParams.schema``)."""
    from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_REQUESTS, TOPIC_RESULTS, InProcessBroker
    from specstream.pipeline.caption_stages import CaptionStage, KeyframeStage
    from specstream.pipeline.messages import PipelineRequest, PipelineResult, Source

    failed_early = failed_early or {}
    summary = CaptionJobSummary(inputs=len(inputs))
    if broker is None:
        broker = InProcessBroker(topic_maxsize={TOPIC_FRAMES: FRAMES_TOPIC_BOUND})
    kstage = KeyframeStage(broker, allowed_roots)
    cstage = CaptionStage(broker, captioner, attention_maps, max_in_flight=max_in_flight)
    params = {"prompt": prompt, "max_new_tokens": max_new_tokens}
    if max_keyframes_per_minute:
        params["max_keyframes_per_minute"] = max_keyframes_per_minute
    if schema is not None:
        params["schema"] = schema
    ids = [f"input-{i}" for i in range(len(inputs))]
    buffered: dict[str, dict[int, PipelineResult]] = {rid: {} for rid in ids}  # results not written yet, by seq
    for i, path in enumerate(inputs):
        if i in failed_early:
            buffered[ids[i]][0] = PipelineResult(id=ids[i], status="error", error=failed_early[i], seq=0, final=True)
            continue
        await broker.publish(TOPIC_REQUESTS, ids[i], PipelineRequest(id=ids[i], task="caption",
                                                                     source=Source(uri=path), qos=qos, params=params))
    t0 = time.perf_counter()
    kt = asyncio.create_task(kstage.run())
    ct = asyncio.create_task(cstage.run())
    await broker.close_topic(TOPIC_REQUESTS)
    pending = {ids[i] for i in range(len(inputs)) if i not in failed_early}
    failed = {ids[i] for i in failed_early}
    next_input, next_seq = 0, 0
    captions_seen = 0

    def flush():
        """Write records as soon as they are in order: inputs in input order, each input's records in seq order
        (a long video's captions appear while it is still being captioned, and survive an interrupt)."""
        nonlocal next_input, next_seq
        wrote = False
        while next_input < len(ids):
            rid = ids[next_input]
            ended = False
            while next_seq in buffered[rid]:
                res = buffered[rid].pop(next_seq)
                rec = res.output if res.status == "ok" else error_record(inputs[next_input], res.error)
                out.write(json.dumps(rec) + "\n")
                if res.status != "ok" and report is not None:
                    report(failure_line(rec))
                summary.records.append(rec)
                wrote, next_seq, ended = True, next_seq + 1, res.final
            if not ended:
                break
            next_input, next_seq = next_input + 1, 0
        if wrote:
            out.flush()

    flush()  # the records of inputs that failed early, up to the first input still in the graph
    if progress is not None and failed_early:
        progress.set_postfix(captions=0, failed=len(failed), refresh=False)
        progress.update(len(failed_early))
    if pending:  # else every input failed early: nothing will arrive
        async for msg in broker.subscribe(TOPIC_RESULTS):
            res: PipelineResult = msg.value
            buffered[res.id][res.seq] = res
            if res.status == "error":
                failed.add(res.id)
            if res.final:
                pending.discard(res.id)
            if progress is not None:
                captions_seen += res.status == "ok"
                progress.set_postfix(captions=captions_seen, failed=len(failed), refresh=False)
                progress.update(1 if res.final else 0)
            flush()
            if not pending:
                break
    await kt
    await broker.close_topic(TOPIC_FRAMES)
    await ct
    summary.seconds = time.perf_counter() - t0
    summary.failed_inputs = len(failed)
    summary.frames_decoded = kstage.frames_decoded
    summary.keyframes = kstage.keyframes
    summary.captions = cstage.stats.captions
    summary.tokens = cstage.stats.tokens
    summary.target_steps = cstage.stats.target_steps
    return summary


def run_caption_job(inputs: list[str], out_path: str | None, target: str | None = None, drafts: list[str] = (),
                    prompt: str = "Describe this image.", max_new_tokens: int = 32,
                    max_keyframes_per_minute: float | None = None, attention_maps: str | None = None,
                    tree: str = "1,1,3,1,1,1,1,1", temporal: bool = True, visual_aware: bool = True,
                    dtype: str = "float32", device: str = "cpu", num_slots: int = 8,
                    show_progress: bool | None = None, schema: dict | None = None) -> CaptionJobSummary:
    """Caption ``inputs`` (files or directories) into ``out_path`` (JSONL; ``-`` for stdout; missing parent
    directories are created). With ``schema`` (a JSON Schema) every caption is grammar-constrained to it and its
    record's ``caption`` is the parsed JSON value; the schema is compiled once the model is loaded, before any
    input is read.

    Every input is checked first (``check_input``: exists, readable, an image or a video); the models load only
    when some input passed. Each failed input gets its record in ``out_path`` and a line on stderr
    (``failure_line``); each file of a directory that is not media is named on stderr (``skipped PATH: ...``)
    and counted in ``CaptionJobSummary.skipped``.

    Raises:
        UnreadableSourceError: no media file among ``inputs``.
        InvalidSchemaError, SchemaCompileTimeoutError: a schema the grammar library cannot compile in time.
        ValueError: a malformed ``tree`` (see ``TreeSpec.parse``).
    """
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.speculative.drafters.model import TreeSpec

    files, skipped = expand_inputs(inputs)
    for path in skipped:
        print(f"skipped {path}: neither an image nor a video (by content or extension)", file=sys.stderr)
    if not files:
        raise UnreadableSourceError(f"no media files in {inputs}")
    tree_spec = TreeSpec.parse(tree)  # a bad --tree fails before any model loads
    failed_early: dict[int, dict] = {}
    for i, path in enumerate(files):  # before any model loads: a job of bad inputs ends at once
        try:
            check_input(path)
        except MediaError as exc:
            failed_early[i] = error_dict(exc)
    if out_path not in (None, "-"):
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)  # before the models load, not after the work
    out = sys.stdout if out_path in (None, "-") else open(out_path, "w")

    def report(line: str) -> None:  # a failed input, named on stderr
        print(line, file=sys.stderr)

    if len(failed_early) == len(files):
        try:
            summary = CaptionJobSummary(inputs=len(files), failed_inputs=len(files), skipped=len(skipped))
            for i, path in enumerate(files):
                rec = error_record(path, failed_early[i])
                out.write(json.dumps(rec) + "\n")
                report(failure_line(rec))
                summary.records.append(rec)
            out.flush()
            return summary
        finally:
            if out is not sys.stdout:
                out.close()
    captioner = None
    progress = None
    try:
        if target is None:
            target, default_draft = default_caption_models()
            drafts = list(drafts) or [str(default_draft)]
        captioner = Captioner(target, drafts, tree_spec, temporal=temporal, visual_aware=visual_aware,
                              num_slots=num_slots, dtype=dtype, device=device,
                              attention_maps=attention_maps is not None)
        if schema is not None:
            captioner.grammar(schema)  # a schema that cannot compile fails the job before any decoding
        show = sys.stderr.isatty() if show_progress is None else show_progress
        if show:
            from tqdm import tqdm

            # a bar over the inputs (their keyframe counts are not known ahead): "captioning: 50%|... | 1/2 [...]"
            progress = tqdm(total=len(files), desc="captioning", unit=" input", file=sys.stderr)
            def report(line: str) -> None:  # a line above the bar, not through it (tqdm.write: stdout unless told)
                progress.write(line, file=sys.stderr)
        summary = asyncio.run(caption_files(files, captioner, out, prompt, max_new_tokens, max_keyframes_per_minute,
                                            Path(attention_maps) if attention_maps else None, progress=progress,
                                            failed_early=failed_early, report=report, schema=schema))
        summary.skipped = len(skipped)
        return summary
    finally:
        if captioner is not None:
            captioner.loop.stop()  # the process's device loop: its thread ends with the job
        if progress is not None:
            progress.close()
        if out is not sys.stdout:
            out.close()
