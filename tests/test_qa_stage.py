"""The two callers of ``stages/qa.py`` give the same results: ``specstream qa``'s embedded run (``qa_job``, which
calls :class:`~specstream.stages.qa.VideoQA` directly) and the worker's broker consumer
(:class:`~specstream.pipeline.qa_stage.QaStage`), on one request with an answer, an empty question, and videos that
are missing or cannot be decoded (the error paths each caller wires on its own)."""

from __future__ import annotations

import asyncio

from qa_fixtures import silent_clip

from specstream.pipeline.messages import PipelineRequest, QaParams, Source
from specstream.pipeline.qa_job import _run_embedded
from specstream.pipeline.qa_stage import QaStage
from specstream.stages.qa import QaOptions, VideoQA


def _hub():
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.serving import HubConfig, ModelHub

    target, draft = default_caption_models(quiet=True)
    return ModelHub(HubConfig(vlm=str(target), vlm_drafts=(str(draft),), vlm_name="tiny", num_slots=2))


def _requests(tmp_path):
    bad = tmp_path / "notavideo.mp4"
    bad.write_text("not a video\n" * 20)
    clip = silent_clip(tmp_path)
    qs = [{"id": "a", "text": "What moves?"}, {"id": "empty", "text": "  "}, {"id": "b", "text": "Where?"}]
    out = []
    for k, path in enumerate((clip, bad, tmp_path / "missing.mp4")):
        params = QaParams(video_id=f"v{k}", questions=qs, **QaOptions(max_new_tokens=2).params())
        out.append(PipelineRequest(id=f"r{k}", task="video_qa", source=Source(uri="file://" + str(path)),
                                   qos="batch", params=params.model_dump(exclude_none=True)))
    return out


def _plain(results):
    return sorted((r.id, r.seq, r.final, r.status, r.output, None if r.error is None else r.error.model_dump())
                  for r in results)


def test_cli_and_worker_consumer_give_the_same_results(tmp_path):
    requests = _requests(tmp_path)
    worker, cli = [], []

    async def via_consumer():
        async def emit(res):
            worker.append(res)

        hub = _hub()
        stage = QaStage(None, hub, emit=emit)
        try:
            for req in requests:
                await stage.handle(req)
        finally:
            await hub.stop()
        return dict(stage.stats)

    worker_stats = asyncio.run(via_consumer())
    cli_stats = asyncio.run(_run_embedded(_hub(), requests, {r.id: None for r in requests}, cli.append, 1))
    assert _plain(cli) == _plain(worker)
    got = {(r.id, r.output["question_id"]): (r.status, r.error and r.error.code) for r in cli}
    assert got == {("r0", "a"): ("ok", None), ("r0", "empty"): ("error", "empty_question"),
                   ("r0", "b"): ("ok", None),
                   ("r1", "a"): ("error", "unsupported_media"), ("r1", "empty"): ("error", "empty_question"),
                   ("r1", "b"): ("error", "unsupported_media"),
                   ("r2", "a"): ("error", "unreadable_source"), ("r2", "empty"): ("error", "empty_question"),
                   ("r2", "b"): ("error", "unreadable_source")}
    assert [len(r.output["tokens"]) for r in cli if r.status == "ok"] == [2, 2]
    assert "missing.mp4: no such file" in next(r.error.message for r in cli if r.id == "r2" and r.seq == 0)
    for key in ("videos", "questions", "answered", "failed", "tokens"):
        assert cli_stats[key] == worker_stats[key], key
    assert (cli_stats["answered"], cli_stats["failed"]) == (2, 7)


def test_video_qa_takes_plain_values():
    """The stage needs no message schema: plain options and question objects."""
    from types import SimpleNamespace

    async def run():
        qa = VideoQA(_hub())
        try:
            return [o async for o in qa.answer_video(None, "x.mp4", [SimpleNamespace(id="q", text=" ",
                                                                                     draft_tokens=None)],
                                                     QaOptions(), "v")]
        finally:
            await qa.hub.stop()

    [(i, exc)] = asyncio.run(run())
    assert i == 0 and exc.code == "empty_question" and "'q' of video 'v' is empty" in exc.message
