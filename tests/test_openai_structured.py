"""``response_format``, ``tools``, ``logprobs``, ``logit_bias`` and ``min_p`` on ``/v1/chat/completions`` with
speculation on (the built-in tiny VLM and its draft; untrained: the content is gibberish, the shape is the
schema's), driven by the official ``openai`` client. Oracles: ``jsonschema`` for shapes, a teacher-forced
forward of the Hugging Face model of the same checkpoint for log-probabilities."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from live_fixtures import ServerThread, free_port
from openai_fixtures import KEY, openai_client, tiny_llava_hf

VLM = "specstream-tiny-llava"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Review(BaseModel):
    verdict: Literal["approve", "reject"]
    blocking: bool
    note: str = Field(max_length=8)


@pytest.fixture(scope="module")
def server():
    from specstream.pipeline.server import ServerSettings

    srv = ServerThread(ServerSettings(port=free_port(), api_keys=[KEY])).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def hf():
    return tiny_llava_hf()


def image_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def hf_scores(hf, text: str, tokens: list[int]) -> torch.Tensor:
    """The target alone's raw logits ``[len(tokens), V]`` at each generated position (teacher-forced)."""
    model, proc = hf
    raw = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                   add_generation_prompt=True)
    ids = proc(text=[raw], return_tensors="pt")["input_ids"]
    full = torch.cat([ids, torch.tensor([tokens])], 1)
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    return logits[ids.shape[1] - 1: full.shape[1] - 1]


def test_parse_with_a_pydantic_model_and_an_image(client, src):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(src["astronaut"])}},
                                         {"type": "text", "text": "Review this."}]}]
    r = client.chat.completions.parse(model=VLM, messages=msgs, response_format=Review, max_tokens=80,
                                      temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Review)
    jsonschema.validate(json.loads(msg.content), Review.model_json_schema())
    # json_object: any JSON object
    r = client.chat.completions.create(model=VLM, messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_n_sampled_choices_each_follow_the_schema_from_one_prefill(client, src):
    """n=3 sampled choices under a JSON Schema, with an image: the forks of the prompt's one prefill each carry a
    grammar state of their own (their first token is drawn through their own constraint), so every choice is JSON
    of the schema (or, cut at max_tokens, a prefix of one)."""
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(src["astronaut"])}},
                                         {"type": "text", "text": "Review this."}]}]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=80, temperature=1.0, seed=5, n=3,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "r", "schema": Review.model_json_schema(), "strict": True}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), Review.model_json_schema())
        else:
            assert c.finish_reason == "length" and c.message.content.startswith("{")
    assert len({c.message.content for c in r.choices}) > 1


def test_a_grammar_that_cannot_finish_ends_with_length_and_the_partial_text(client):
    r = client.chat.completions.create(model=VLM, messages=ASK, max_tokens=3, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": Review.model_json_schema(), "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 3
    head = '{"verdict": "'  # the schema's first key, forced
    assert c.message.content and (head.startswith(c.message.content) or c.message.content.startswith(head))


def test_named_and_required_tool_calls_follow_the_parameters_schema(client):
    r = client.chat.completions.create(model=VLM, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    r = client.chat.completions.create(model=VLM, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
                                       temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": TIME}[
        call.function.name])
    # a tool result goes back to the model in the next turn
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    r2 = client.chat.completions.create(model=VLM, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=4,
                                        temperature=0)
    assert r2.choices[0].message.tool_calls is None and isinstance(r2.choices[0].message.content, str)


def test_streamed_tool_call_is_the_whole_one_in_fragments(client):
    kw = dict(model=VLM, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 2  # the arguments come in fragments, step by step
    assert "".join(tc.function.arguments or "" for tc in calls) == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_hides_the_tools_and_auto_reads_a_call_or_text(client):
    plain = client.chat.completions.create(model=VLM, messages=ASK, max_tokens=6, temperature=0)
    none = client.chat.completions.create(model=VLM, messages=ASK, max_tokens=6, temperature=0, tools=TOOLS,
                                          tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    auto = client.chat.completions.create(model=VLM, messages=ASK, max_tokens=6, temperature=0, tools=TOOLS)
    c = auto.choices[0]  # the untrained model writes text, which auto returns as content
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


def test_auto_stream_reads_a_call_written_as_text():
    from specstream.pipeline.tool_calls import ToolCallStream, parse_tool_call, tool_plan

    plan = tool_plan(TOOLS, "auto")
    s = ToolCallStream(plan)
    out = s.feed(' {"name": "get_time", ') + s.feed('"arguments": {"zone":"UTC"}}')
    rest, reason = s.finish("stop")
    assert out == [] and reason == "tool_calls"
    assert rest[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert rest[1]["tool_calls"][0]["function"] == {"arguments": '{"zone":"UTC"}'}  # as the model wrote it
    s = ToolCallStream(plan)
    assert s.feed("Hi ") == [{"content": "Hi "}] and s.finish("stop") == ([], "stop")
    assert parse_tool_call(plan, '{"name": "nope", "arguments": {}}') is None


def test_logprobs_are_the_target_s_own_with_logit_bias_and_min_p(client, hf):
    text = "Hello there"
    msgs = [{"role": "user", "content": text}]
    base = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                          extra_body={"return_token_ids": True})
    toks = base.choices[0].model_extra["token_ids"]
    ban = toks[1]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       logit_bias={str(ban): -100, "7": 5.0},
                                       extra_body={"return_token_ids": True, "min_p": 0.05})
    got = r.choices[0].model_extra["token_ids"]
    assert got != toks
    scores = hf_scores(hf, text, got)
    scores[:, ban] -= 100.0
    scores[:, 7] += 5.0
    assert got == scores.argmax(-1).tolist()  # greedy under the biased target, token for token
    keep = scores >= scores.max(-1, keepdim=True).values + torch.log(torch.tensor(0.05))
    want = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1).gather(1, torch.tensor(got)[:, None])[:, 0]
    lps = [e.logprob for e in r.choices[0].logprobs.content]
    eos = [k for k, t in enumerate(got) if t == got[-1]] if r.choices[0].finish_reason == "stop" else []
    want = [v for k, v in enumerate(want.tolist()) if k not in eos[-1:]]
    assert lps == pytest.approx(want, abs=1e-4)
    # without processors: the plain target's log-softmax
    plain = torch.log_softmax(hf_scores(hf, text, toks), -1).gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
    n = len(base.choices[0].logprobs.content)
    assert [e.logprob for e in base.choices[0].logprobs.content] == pytest.approx(plain[:n], abs=1e-4)


def test_min_p_sampling_keeps_only_tokens_above_the_threshold(client, hf):
    msgs = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=VLM, messages=msgs, max_tokens=12, temperature=1.5, seed=3,
                                       extra_body={"return_token_ids": True, "min_p": 0.2})
    got = r.choices[0].model_extra["token_ids"]
    probs = torch.softmax(hf_scores(hf, "Hello there", got) / 1.5, -1)
    chosen = probs.gather(1, torch.tensor(got)[:, None])[:, 0]
    assert bool((chosen >= 0.2 * probs.max(-1).values - 1e-6).all())


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuchtype"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_bad_structure_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VLM, messages=ASK, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error" and e.value.param == param


def test_bias_and_min_p_processors_on_chosen_logits():
    import math

    from specstream.stages.speculative.logits import LogitBias, MinP, apply_logits_processors_rows

    scores = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 0.0, 5.0, 1.0]])
    bias = LogitBias([(3, 10.0), (9, 1.0)])  # id 9 is past the vocabulary: ignored
    out = apply_logits_processors_rows([(bias, MinP(0.5, 1.0)), (bias, MinP(0.5, 2.0))], [[], []], scores)
    # row 0: biased [2, 1, 0, 7]; keep s >= 7 + log 0.5 -> only id 3; row 1: [0, 0, 5, 11], keep s >= 11 + 2 log 0.5
    assert torch.isinf(out[0, :3]).all() and out[0, 3] == 7.0
    assert torch.isinf(out[1, :3]).all() and out[1, 3] == 11.0
    out = apply_logits_processors_rows([(MinP(math.exp(-1.5), 1.0),)], [[]], torch.tensor([[2.0, 1.0, 0.0, 0.6]]))
    assert out[0].tolist() == [2.0, 1.0, float("-inf"), pytest.approx(0.6)]
