"""``n > 1`` on ``/v1/chat/completions`` and ``/v1/completions``: n choices of one prompt share its prefill (one
prefill, then n decode rows of the same engine steps), each with its own random stream. Greedy gives n identical choices (equal to ``n=1``), sampled
choices differ, streaming carries each choice's ``index``, usage counts the prompt once."""

from __future__ import annotations

import json
import time

import pytest

VLM = "specstream-tiny-llava"


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    app = create_app(ServerSettings())
    app.state.specstream.loop.start()  # the device loop without the lifespan: no speech model needed
    yield TestClient(app)
    app.state.specstream.loop.stop(30.0)


def _chat(client, **kw):
    body = {"model": VLM, "max_tokens": 8, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Tell me a story."}], **kw}
    res = client.post("/v1/chat/completions", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def test_greedy_choices_are_identical_and_equal_one_choice(client):
    one = _chat(client, temperature=0)
    three = _chat(client, temperature=0, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    ids = [c["token_ids"] for c in three["choices"]]
    assert ids == [one["choices"][0]["token_ids"]] * 3 and len(ids[0]) == 8
    assert three["usage"] == {"prompt_tokens": one["usage"]["prompt_tokens"], "completion_tokens": 24,
                              "total_tokens": one["usage"]["prompt_tokens"] + 24}
    res = client.post("/v1/completions", json={"model": VLM, "prompt": "Once upon a time", "max_tokens": 6,
                                               "temperature": 0, "n": 2, "return_token_ids": True})
    assert res.status_code == 200, res.text
    c = res.json()["choices"]
    assert [x["index"] for x in c] == [0, 1] and c[0]["token_ids"] == c[1]["token_ids"] and c[0]["text"] == c[1]["text"]


def test_n_choices_prefill_the_prompt_once(client):
    """One prefill, n decode rows: the plans of the request's steps prefill the prompt's tokens once for n=4
    (the old code prefilled each choice: 4x), and the choices are the single request's greedy output."""
    loop = client.app.state.specstream.loop
    one = _chat(client, temperature=0)
    plans, schedule = [], loop.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    loop.scheduler.schedule = recording
    try:
        four = _chat(client, temperature=0, n=4)
    finally:
        del loop.scheduler.schedule
    prompt = four["usage"]["prompt_tokens"]
    assert sum(p.num_tokens for plan in plans for p in plan.prefills) == prompt
    assert sum(len(plan.forks) for plan in plans) == 3
    assert [c["token_ids"] for c in four["choices"]] == [one["choices"][0]["token_ids"]] * 4


def test_sampled_choices_have_their_own_streams(client):
    four = _chat(client, temperature=1.0, seed=7, n=4)
    ids = [tuple(c["token_ids"]) for c in four["choices"]]
    assert len(set(ids)) == 4  # four seeds (7, 8, 9, 10): four different samples of 8 tokens over 50k ids


def test_streamed_choices_carry_their_index(client):
    body = {"model": VLM, "max_tokens": 8, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    texts, finishes, roles, usage = {0: "", 1: ""}, {}, [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj["choices"]:
                if "role" in ch["delta"]:
                    roles.append(ch["index"])
                texts[ch["index"]] += ch["delta"].get("content") or ""
                if ch["finish_reason"]:
                    finishes[ch["index"]] = ch["finish_reason"]
    greedy = _chat(client, temperature=0)["choices"][0]
    assert roles == [0, 1] and set(finishes) == {0, 1}
    assert texts[0] == texts[1] == greedy["message"]["content"]
    assert usage["completion_tokens"] == 16


def test_n_choices_cost_against_n_single_requests(client):
    """Not a speed assertion: the ratio is printed for the report (machine shared and loaded)."""
    _chat(client, temperature=0, max_tokens=16)
    t0 = time.perf_counter()
    for _ in range(4):
        _chat(client, temperature=0, max_tokens=16)
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    _chat(client, temperature=0, max_tokens=16, n=4)
    together = time.perf_counter() - t0
    print(f"n=4 in one request {together:.2f} s vs 4 requests one after another {sequential:.2f} s: "
          f"ratio {together / sequential:.2f}")
