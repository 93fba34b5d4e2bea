"""One release point per request: after image chats, QA questions and cancelled captions through one ModelHub (the
server's and worker's door to the VLM), no per-request registry of the device loop, its scheduler or its executors
holds anything (issue 20, item 4).

Every dict, set, list and deque attribute of those objects is searched for the ids of this run's requests (a
generic check: a registry nobody listed is found too), and the known registries are asserted empty by name: the
scheduler's one registry (``_entries``, seen through ``requests``) and its phase indexes among them. The counts are
the issue's (200 chats, 50 questions, 20 cancelled captions): 8.5 s for the test's body on the shared 2-core
machine (the fastest of four runs; 12.5 to 17 s at load averages of 3 to 4.5; 40/10/10 took 8.6 s: loading the
models dominates). Before the fix, ``DeviceLoop.visual_attention`` kept the attention rows of every image chat and
QA question for ever (only the caption stage popped its own): one entry per chat and question.
"""

from __future__ import annotations

import asyncio
import collections

from media import sources
from qa_fixtures import silent_clip

N_CHATS, N_QUESTIONS, N_CANCELLED = 200, 50, 20


def _holders(obj, ids: set[str]) -> dict[str, int]:
    """Attribute name -> how many of ``ids`` it holds (as dict keys, or elements of a set, list or deque)."""
    out = {}
    for name, value in vars(obj).items():
        if isinstance(value, dict):
            keys = value.keys()
        elif isinstance(value, (set, frozenset, list, collections.deque)):
            keys = value
        else:
            continue
        n = sum(1 for k in keys if isinstance(k, str) and k in ids)
        if n:
            out[name] = n
    return out


def test_image_chats_qa_and_cancelled_captions_leave_no_per_request_state(tmp_path):
    from specstream.modalities.image import load_image
    from specstream.pipeline.defaults import default_caption_models
    from specstream.pipeline.messages import QaParams
    from specstream.stages.qa import VideoQA
    from specstream.stages.serving import GenerationParams, HubConfig, ModelHub, Prompt, Turn

    target, draft = default_caption_models(quiet=True)
    hub = ModelHub(HubConfig(vlm=str(target), vlm_drafts=(str(draft),), vlm_name="tiny", num_slots=4))
    image = load_image(sources()["astronaut"])
    clip = silent_clip(tmp_path)
    ids: set[str] = set()

    async def main():
        loop = hub.loop
        ran = []
        for start in range(0, N_CHATS, 8):  # image chats, 8 at a time
            gens = await asyncio.gather(*[hub.generate(Prompt(turns=(Turn("user", (image, f"Describe {i}.")),)),
                                                       GenerationParams(max_new_tokens=2))
                                          for i in range(start, min(N_CHATS, start + 8))])
            ran.extend(gens)
        assert [len(g.tokens) for g in ran] == [2] * N_CHATS
        stage = VideoQA(hub)
        params = QaParams(questions=[{"id": f"q{i}", "text": f"What happens {i}?"} for i in range(N_QUESTIONS)],
                          max_new_tokens=2, use_transcript=False)
        ctx = await stage.video_context(str(clip), "clip.mp4", params)
        answers = [await stage.answer(ctx, q.text, params) for q in params.questions]
        assert [len(rec["tokens"]) for rec, _ in answers] == [2] * N_QUESTIONS
        cap = (await hub.model("vlm")).captioner
        prepared = cap.vlm.prepare(image, "Describe this image.")
        tasks, started = [], []
        for i in range(N_CANCELLED):  # half cancelled once decoding, half while still queued
            req = cap.make_request(prepared, 200)
            ids.add(req.request_id)
            began = asyncio.Event()
            started.append(began)
            tasks.append(asyncio.create_task(loop.submit(req, on_tokens=lambda d, e=began: e.set())))
        for i, (task, began) in enumerate(zip(tasks, started)):
            if i % 2 == 0:
                await began.wait()
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        for _ in range(200):  # the loop frees a cancelled request's slot at its next step
            if not await asyncio.to_thread(loop.call, loop.has_work):
                break
            await asyncio.sleep(0.05)
        return await asyncio.to_thread(loop.call, lambda: _snapshot(loop))

    def _snapshot(loop):
        sched = loop.scheduler
        for r in list(sched.requests.values()) + list(sched.running.values()):
            ids.add(r.request_id)
        found = {"loop": _holders(loop, ids_of(loop)), "scheduler": _holders(sched, ids_of(loop))}
        for name, runner in loop.runners.items():
            found[f"executor {name}"] = _holders(runner.executor, ids_of(loop))
        named = {"loop._entries": len(loop._entries), "scheduler.requests": len(sched.requests),
                 "scheduler.running": len(sched.running), "scheduler.prefilling": len(sched.prefilling),
                 "scheduler._queued": len(sched._queued), "scheduler._entries": len(sched._entries),
                 "scheduler.waiting": len(sched.waiting), "scheduler._in_flight": len(sched._in_flight)}
        for name, runner in loop.runners.items():
            named[f"executor {name}.states"] = len(runner.executor.states)
            named[f"executor {name}.encoder_outputs"] = len(runner.executor.encoder_outputs)
        return found, named

    def ids_of(loop) -> set[str]:
        # every request id the hub's captioner handed out in this run: cap-0 .. cap-N
        cap_ids = {f"cap-{i}" for i in range(N_CHATS + N_QUESTIONS + N_CANCELLED + 8)}
        return ids | cap_ids

    try:
        found, named = asyncio.run(main())
    finally:
        asyncio.run(hub.stop())
    assert {k: v for k, v in found.items() if v} == {}
    assert named == {k: 0 for k in named}
