"""``specstream bench spec --real --structured``: grammar-constrained decoding with and without speculation.

Two JSON-schema workloads, greedy: a 4-field code-review object (:data:`REVIEW_SCHEMA`) and a caption-like object
(:data:`CAPTION_SCHEMA`), each prompt alone and all in one batch (``batch`` requests, the prompts in turn).
Configurations, all under the same grammar constraint (``stages/speculative/grammar.py``):

- ``constrained/no-spec``: one token per target step (the baseline of ``vs_no_spec``);
- ``constrained/grammar-only``: the schema's forced tokens as the only draft (``GrammarDrafter``, no model);
- ``constrained/specinfer``: the model draft on SpecInfer's tree ``1,1,3,1,1,1,1,1`` plus the forced tokens;
- ``constrained/grammar+ngram`` (only when named in ``configs``): the forced tokens and the n-gram (prompt lookup)
  drafter after them, no draft model.

Reported per workload and configuration: tokens/s, tau (committed tokens per target step), the forced-token
drafter's share of accepted draft tokens (its accepted tokens / all accepted draft tokens; its own counter misses a
request's finishing step, where the executor observes nothing, so the share is a slight undercount), the constraint's
time per target step (``GrammarConstraint`` methods, wall time on the device loop's thread: the bitmask fill of
the nodes, ``mask_s``, and everything the constraint does, ``constraint_s``, which includes applying the masks to
the scores) and its share of the step, whether every output equals ``constrained/no-spec``'s, and whether every
finished output validates against its schema (``jsonschema``). Outputs cut by the token limit cannot validate;
they are counted as ``cut``.

:func:`run_structured` takes checkpoint paths, a tokenizer table and a decode function, so the same code runs on
the real pair (:func:`main`) and on tiny models (the dry-run test).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specstream.pipeline.bench.harness import machine_info, machine_line, md_table, ratio, write_results

REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["approve", "request_changes", "comment"]},
        "severity": {"type": "integer", "minimum": 0, "maximum": 5},
        "file": {"type": "string", "maxLength": 40},
        "comment": {"type": "string", "maxLength": 200},
    },
    "required": ["verdict", "severity", "file", "comment"],
    "additionalProperties": False,
}
CAPTION_SCHEMA = {
    "type": "object",
    "properties": {
        "objects": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "action": {"type": "string", "maxLength": 80},
        "text_on_screen": {"anyOf": [{"type": "string", "maxLength": 60}, {"type": "null"}]},
    },
    "required": ["objects", "action", "text_on_screen"],
    "additionalProperties": False,
}
PROMPTS = {
    "review": ("Review this change to utils.py and answer as JSON with verdict, severity, file and comment:\n"
               "-    return sum(x) / len(x)\n+    return sum(x) / max(1, len(x))", REVIEW_SCHEMA),
    "caption": ("Describe a busy city street at night for a video caption, as JSON with the objects seen, the "
                "action and any text on screen.", CAPTION_SCHEMA),
}
CONFIGS = {  # name -> (tree, model draft?, speculate, n-gram drafter?)
    "constrained/no-spec": (None, False, False, False),
    "constrained/grammar-only": ("1,1,3,1,1,1,1,1", False, True, False),
    "constrained/grammar+ngram": ("1,1,3,1,1,1,1,1", False, True, True),
    "constrained/specinfer": ("1,1,3,1,1,1,1,1", True, True, False),
}
#: what runs when no configuration is named
DEFAULT_CONFIGS = ("constrained/no-spec", "constrained/grammar-only", "constrained/specinfer")


def check_configs(configs: list[str] | None) -> None:
    """Raises ValueError naming :data:`CONFIGS` when ``configs`` holds another name."""
    unknown = [c for c in configs or () if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--structured configurations are {', '.join(CONFIGS)}; got {', '.join(unknown)}")


@contextlib.contextmanager
def constraint_timer():
    """Accumulate the wall time spent in :class:`GrammarConstraint` (outermost calls of ``apply``, ``masks``,
    ``forced_tokens``, ``__call__``) and in its bitmask fill (``masks``) while the block runs. Yields the dict
    ``{"constraint_s", "mask_s"}``."""
    from specstream.stages.speculative.grammar import GrammarConstraint

    acc = {"constraint_s": 0.0, "mask_s": 0.0}
    depth = [0]
    originals = {name: getattr(GrammarConstraint, name) for name in ("apply", "masks", "forced_tokens", "__call__")}

    def wrap(name, fn):
        def timed(self, *args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                depth[0] -= 1
                if depth[0] == 0:
                    acc["constraint_s"] += dt
                if name == "masks":
                    acc["mask_s"] += dt
        return timed

    for name, fn in originals.items():
        setattr(GrammarConstraint, name, wrap(name, fn))
    try:
        yield acc
    finally:
        for name, fn in originals.items():
            setattr(GrammarConstraint, name, fn)


def run_structured(target: Path, draft: Path, info, prompts: dict[str, tuple[list[int], dict]],
                   decode: Callable[[list[int]], str], new_tokens: int, batch: int, eos: tuple[int, ...],
                   configs: list[str] | None = None, adaptive: bool = True, log=print,
                   dtype: str = "float32") -> dict:
    """Run every configuration on every workload (each prompt alone, then ``batch`` requests together).

    Args:
        target, draft: checkpoint directories (one tokenizer).
        info: xgrammar ``TokenizerInfo`` of the vocabulary (``grammar.tokenizer_info`` / ``raw_vocab_info``).
        prompts: name -> (prompt token ids, JSON Schema).
        decode: token ids -> text (the output checked against its schema; the end-of-sequence ids are dropped).
        new_tokens: token limit per request; batch: requests in the batch workload (0: none).
        eos: end-of-sequence ids (end every request; dropped before decoding).
        configs: names of :data:`CONFIGS` to run (default: :data:`DEFAULT_CONFIGS`); ``constrained/no-spec`` is
            the ratios' baseline.
        dtype: weight precision of target and draft (``float32``, ``bfloat16``, ``int8``, ``int4``; see
            ``docs/models.md``).
    Returns ``{"configs": {name: {workload: record}}, "new_tokens", "batch", "dtype", "target_weight_bytes"}``.
    Raises:
        ValueError: a name in ``configs`` that is not one of :data:`CONFIGS`.
    """
    import jsonschema

    from specstream.kernels.quant import weight_bytes
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.stages.speculative.grammar import Grammar

    grammars = {name: Grammar.from_json_schema(schema, info) for name, (_, schema) in prompts.items()}
    loads = {name: [name] for name in prompts}
    if batch:
        names = list(prompts)
        loads[f"batch{batch}"] = [names[i % len(names)] for i in range(batch)]
    max_len = max(len(ids) for ids, _ in prompts.values()) + new_tokens + 32
    check_configs(configs)
    results: dict = {"configs": {}, "new_tokens": new_tokens, "batch": batch, "dtype": dtype}
    names = configs or list(DEFAULT_CONFIGS)
    # the target (and the draft, when a configuration uses it) are loaded once; each configuration reconfigures
    loaded = SpeculativeEngine.from_checkpoints(target, [draft] if any(CONFIGS[c][1] for c in names) else [],
                                                config=EngineConfig(num_slots=1, max_len=max_len), dtype=dtype)
    for cname in names:
        tree, with_draft, speculate, with_ngram = CONFIGS[cname]
        config = EngineConfig(num_slots=max(len(v) for v in loads.values()), max_len=max_len,
                              tree=TreeSpec.parse(tree or "1"), adaptive=adaptive,
                              prefix_reuse=False)  # the warm-up runs the same prompt: keep the measured prefill
        engine = loaded.reconfigured(config, drafts=with_draft, ngram=with_ngram)
        gd = engine.executor.grammar_drafter
        results.setdefault("target_weight_bytes", weight_bytes(engine.executor.target))  # one target for all

        def generate(names):
            reqs = []
            for n in names:
                ids = prompts[n][0]
                reqs.append(engine.add_request(engine.make_request(
                    ids, new_tokens, speculate=speculate, logits_processors=[grammars[n].constraint(len(ids))],
                    eos_token_ids=tuple(eos))))
            engine.run()
            for r in reqs:
                engine.loop.pop(r.request_id)
            return reqs

        generate([next(iter(prompts))])  # warm-up
        per = {}
        for wname, names in loads.items():
            p0, a0 = (gd.proposed, gd.accepted) if gd is not None else (0, 0)
            f0 = engine.target_forwards
            with constraint_timer() as acc:
                t = time.perf_counter()
                reqs = generate(names)
                secs = time.perf_counter() - t
            outs = [list(r.output_ids) for r in reqs]
            steps = engine.target_forwards - f0  # engine steps (a step verifies every row of the batch)
            committed = sum(map(len, outs))
            row_steps = sum(r.stats.target_steps for r in reqs)
            accepted_draft = sum(sum(r.stats.accepted_per_step) for r in reqs)  # bonus tokens excluded
            forced_acc = (gd.accepted - a0) if gd is not None else 0
            valid, cut = 0, 0
            for n, out, r in zip(names, outs, reqs):
                if r.finish_reason != "eos":
                    cut += 1
                    continue
                jsonschema.validate(json.loads(decode([t for t in out if t not in eos])), prompts[n][1])
                valid += 1
            per[wname] = {
                "s": secs, "requests": len(names), "tokens": committed, "tok_s": committed / secs,
                "tau": committed / max(1, row_steps),
                "steps": steps, "outputs": outs, "valid": valid, "cut": cut,
                "forced_proposed": (gd.proposed - p0) if gd is not None else 0, "forced_accepted": forced_acc,
                "forced_share": forced_acc / accepted_draft if accepted_draft > 0 else 0.0,
                "constraint_s_per_step": acc["constraint_s"] / max(1, steps),
                "mask_s_per_step": acc["mask_s"] / max(1, steps),
                "constraint_share": acc["constraint_s"] / secs, "mask_share": acc["mask_s"] / secs,
            }
            rec = per[wname]
            log(f"{cname} {wname}: {rec['tok_s']:.2f} tokens/s tau={rec['tau']:.2f} forced share "
                f"{rec['forced_share']:.2f} constraint {1000 * rec['constraint_s_per_step']:.2f} ms/step "
                f"({100 * rec['constraint_share']:.1f}%), valid {valid}/{len(outs)} (cut {cut})")
        results["configs"][cname] = per
        engine = gd = None  # its caches freed before the next configuration's are made
        gc.collect()
    base = results["configs"].get("constrained/no-spec")
    for cname, per in results["configs"].items():
        for wname, rec in per.items():
            if base is not None and wname in base:
                rec["vs_no_spec"] = ratio(rec["tok_s"], base[wname]["tok_s"])
                rec["identical"] = rec["outputs"] == base[wname]["outputs"]
    return results


def markdown(results: dict) -> str:
    """The results as one markdown table."""
    machine = ""
    bound = None
    if "cpu" in results:
        machine = (f" CPU: {results['cpu']}; read bandwidth {results['read_bandwidth_gbs']:.1f} GB/s "
                   f"({results['threads']} threads).")
        if results.get("target_weight_bytes"):
            # one target forward per token reads every weight once: the no-speculation decode bound
            bound = results["read_bandwidth_gbs"] * 1e9 / results["target_weight_bytes"]
            machine += (f" Target weights {results['target_weight_bytes'] / 2**30:.2f} GiB: one token per target "
                        f"forward is bound at {bound:.1f} tokens/s per request (a batch of B: B times that).")
    header = ["config", "workload", "tokens/s", "of bound", "vs no-spec", "tau", "forced share of accepted",
              "constraint ms/step (share)", "mask ms/step", "identical", "valid / cut"]
    def share(r: dict) -> str:  # of the bound of its batch: one forward gives each request a token
        return f"{100 * r['tok_s'] / (bound * r.get('requests', 1)):.0f} %" if bound else "-"

    rows = [[cname, wname, f"{r['tok_s']:.2f}", share(r), f"{r.get('vs_no_spec', 1.0):.2f}x", f"{r['tau']:.2f}",
             f"{r['forced_share']:.2f} ({r['forced_accepted']}/{r['forced_proposed']} proposed)",
             f"{1000 * r['constraint_s_per_step']:.2f} ({100 * r['constraint_share']:.1f}%)",
             f"{1000 * r['mask_s_per_step']:.2f}", r.get('identical', '-'), f"{r['valid']} / {r['cut']}"]
            for cname, per in results["configs"].items() for wname, r in per.items()]
    lines = [f"Constrained greedy decoding, {results['new_tokens']} new tokens per request, "
             f"{results.get('dtype', 'float32')} weights.{machine}", "",
             *md_table(header, rows)]
    return "\n".join(lines)


def main(args) -> int:
    """``specstream bench spec --real --structured``: the real Qwen2.5-Coder pair (fetched on first use)."""
    import torch
    from transformers import AutoTokenizer

    from specstream.modalities.text import chat_prompt_ids
    from specstream.pipeline.bench.spec_real import DRAFT, TARGET
    from specstream.stages.serving import _eos_ids
    from specstream.stages.speculative.grammar import tokenizer_info
    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint

    configs = args.configs or None
    try:
        check_configs(configs)  # before any model loads
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    show = False if args.no_progress else None
    tckpt = resolve_checkpoint(TARGET, show_progress=show)
    target, draft = tckpt.path, resolve_checkpoint(DRAFT, show_progress=show).path
    tok = AutoTokenizer.from_pretrained(str(target))
    eos = _eos_ids(tckpt)  # the config's and the generation config's (Qwen ends a turn with <|im_end|>)
    cfg = json.loads((Path(target) / "config.json").read_text())
    info = tokenizer_info(tok, cfg["vocab_size"], eos)
    prompts = {n: (chat_prompt_ids(target, text), schema) for n, (text, schema) in PROMPTS.items()}
    machine = machine_info(args.threads)  # not ``info``: that name is the vocabulary's table above
    print(machine_line(machine))
    dtypes = args.dtypes or ["float32"]
    every: list[dict] = []
    for dtype in dtypes:
        results = run_structured(target, draft, info, prompts,
                                 lambda ids: tok.decode(ids, skip_special_tokens=True),
                                 args.max_new_tokens, 0 if args.no_batch else 8, eos, configs=configs,
                                 adaptive=not args.fixed_trees, dtype=dtype)
        results.update({"cpu": machine["cpu"], "read_bandwidth_gbs": machine["read_bandwidth"] / 1e9,
                        "threads": args.threads})
        table = markdown(results)
        name = "bench_structured" if dtype == "float32" else f"bench_structured_{dtype}"
        write_results(args.out, name, results, markdown=table, indent=1)
        print(table)
        every.append(results)
    flags = [rec.get("identical") for results in every for per in results["configs"].values()
             for rec in per.values()]
    return 0 if all(f is not False for f in flags) else 1
