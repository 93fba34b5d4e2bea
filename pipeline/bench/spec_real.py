"""``specstream bench spec --real``: speculative decoding on the real Qwen2.5-Coder pair against Hugging Face.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M; fetched with ``specstream models
fetch`` on first use and converted once per weight format: float32 and bfloat16 from the de-quantized tensors, int4
from the file's own Q4_K blocks, the file llama.cpp runs). ``--dtypes`` (default float32), ``--threads`` intra-op
threads (2).

Workloads: each prompt alone (code, prose, caption-like, repetitive; all with the chat template), then batches:
``--batch-sizes`` (default one batch of ``2 x prompts``, two of each). Configurations:

- ``hf/greedy``: transformers ``generate(do_sample=False)`` (the batch runs as one padded batch);
- ``hf/assisted``: transformers assisted generation with the draft (``assistant_model``), one request at a time
  (it takes batch size 1), so a batch runs its requests one after another;
- ``hf/prompt-lookup``: transformers ``prompt_lookup_num_tokens=10``, one request at a time;
- ``ours/no-spec``: the engine, one token per target step (the baseline of ``vs_no_spec``);
- ``ours/chain-2``, ``ours/chain-4``: a chain of k draft tokens (tree ``1,1`` / ``1,1,1,1``);
- ``ours/specinfer``: SpecInfer's tree ``1,1,3,1,1,1,1,1`` (21 nodes with the root);
- ``ours/chain-20``: a chain with as many nodes as SpecInfer's tree (the tree-versus-chain tau comparison);
- ``ours/dynamic``: ``dynamic:20`` (21 nodes, expanded by cumulative draft probability);
- ``ours/merged``: the draft and the n-gram drafter merged (SpecInfer's tree).

Each configuration decodes every workload once after a short warm-up (``--rounds N``: N times, medians; each
speculative run then paired with the same engine without speculation, :func:`run_ours`); decode wall time
excludes loading.
Reported per workload and configuration: tokens/s end to end (prefill included), ours also after the last first
token (decode tokens/s) and the time to it, tau (ours: committed tokens per target step), the ratios against
``ours/no-spec`` and ``hf/assisted`` of the same workload, and whether every output equals ``hf/greedy``'s of the
same prompt run alone. With ``--llama-bench`` the anchor is llama.cpp on the target's GGUF file in the same run:
its plain decode (``-n N``) against our decode tokens/s, and its end-to-end rate (prompt processing of the
prompt's length, ``-p P``, plus decoding; :func:`llama_end_to_end`) against our end-to-end rate. The host time
per step (step wall time minus the time inside model forwards, measured with ``torch.profiler`` around
``engine.step`` and each decoder's ``forward_batch``) is measured on the batch with SpecInfer's 21-node tree.

The Hugging Face configurations run in a child process that ends before our models load, and our engines are
loaded one at a time: the float32 HF models (~10 GB) and ours never share the memory.

Our engines run with the default adaptive tree budget (``EngineConfig.adaptive``: the tree shrinks, or drafting
stops, when acceptance times the measured draft cost says it does not pay). ``--fixed-trees`` turns it off, so
every step drafts the configured tree: the run that compares trees with chains at the same node count. Without
``hf/greedy`` in the run, outputs are compared with ``ours/no-spec`` alone (which equals HF greedy's in the full
run).

``--structured`` runs the grammar-constrained workloads instead (``pipeline/bench/structured.py``).

Results: ``OUT/bench_spec_real.json``, ``OUT/bench_spec_real.png`` and ``OUT/bench_spec_real.md`` (the tables;
``--table-from JSON`` rebuilds them without running anything); with ``--fixed-trees``,
``OUT/bench_spec_real_fixed.*``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specstream.pipeline.bench.harness import (fmt_ratio, machine_info, md_table, paired_ratio, pyplot, ratio,
                                               save_figure, write_results)

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "prose": "Explain in three sentences what a keyframe is in video compression.",
    "caption": "Describe a busy city street at night for a video caption.",
    "repetitive": (
        "Rename the variable `total` to `count` in this function and return the whole function unchanged "
        "otherwise:\n\n```python\ndef count_words(lines):\n    total = 0\n    for line in lines:\n"
        "        for word in line.split():\n            if word.strip():\n                total += 1\n"
        "    return total\n```"),
}
CONFIGS = {  # name -> (tree, drafts: "draft" | "draft+ngram" | None)
    "ours/no-spec": (None, None),
    "ours/chain-2": ("1,1", "draft"),
    "ours/chain-4": ("1,1,1,1", "draft"),
    "ours/specinfer": ("1,1,3,1,1,1,1,1", "draft"),
    "ours/chain-20": (",".join(["1"] * 20), "draft"),
    "ours/dynamic": ("dynamic:20", "draft"),
    "ours/merged": ("1,1,3,1,1,1,1,1", "draft+ngram"),
}
HF_CONFIGS = ("hf/greedy", "hf/assisted", "hf/prompt-lookup")
PROFILE_TREE = "1,1,3,1,1,1,1,1"


def prompt_ids(checkpoint: Path, names: list[str]) -> dict[str, list[int]]:
    from specstream.modalities.text import chat_prompt_ids

    return {n: chat_prompt_ids(checkpoint, PROMPTS[n]) for n in names}


def workloads(names: list[str], batch_sizes: Sequence[int] = ()) -> dict[str, list[str]]:
    """Workload name -> prompt names: each prompt alone, then ``batch-N`` for each N of ``batch_sizes`` above 1,
    the prompts in turn and grouped (``batch-4`` of code, prose: code, code, prose, prose)."""
    out = {n: [n] for n in names}
    for size in sorted({int(b) for b in batch_sizes if int(b) > 1}):
        out[f"batch-{size}"] = [names[i * len(names) // size] for i in range(size)]
    return out


# -- Hugging Face, in a child process ------------------------------------------------------------------------


def hf_worker(spec_path: str, out_path: str) -> int:
    """Run the HF configurations (child process entry point); writes their outputs and times as JSON."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()
    draft = None
    if "hf/assisted" in spec["configs"]:
        draft = AutoModelForCausalLM.from_pretrained(spec["draft"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = spec["pad"]
    ids = spec["prompt_ids"]
    n = spec["new_tokens"]

    def one(prompt: list[int], new: int = n, **kw) -> list[int]:
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                  pad_token_id=pad, eos_token_id=spec["eos"], **kw)
        return out[0, len(prompt):].tolist()

    def padded(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = target.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                                  eos_token_id=spec["eos"])
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in spec["eos"]), len(row))
            rows.append(row[:cut])  # a finished row is padded with pad ids after its stop token
        return rows

    kwargs = {"hf/greedy": {}, "hf/assisted": {"assistant_model": draft},
              "hf/prompt-lookup": {"prompt_lookup_num_tokens": 10}}
    results: dict = {"load_s": load_s, "configs": {}}
    first = ids[spec["workloads"][next(iter(spec["workloads"]))][0]]
    for name in spec["configs"]:
        one(first, 2, **kwargs[name])  # warm-up
        per = {}
        for wname, prompts in spec["workloads"].items():
            batch = [ids[p] for p in prompts]
            t = time.perf_counter()
            if name == "hf/greedy" and len(batch) > 1:
                outs = padded(batch)
            else:  # assisted generation and prompt lookup take one request at a time
                outs = [one(p, **kwargs[name]) for p in batch]
            per[wname] = {"s": time.perf_counter() - t, "outputs": outs}
            print(f"{name} {wname}: {sum(map(len, outs)) / per[wname]['s']:.2f} tokens/s", file=sys.stderr,
                  flush=True)
        results["configs"][name] = per
    Path(out_path).write_text(json.dumps(results))
    return 0


def run_hf(target: Path, draft: Path, ids: dict, loads: dict, configs: list[str], new_tokens: int, threads: int,
           eos: list[int], pad: int, tmp: Path) -> dict:
    spec = {"target": str(target), "draft": str(draft), "prompt_ids": ids, "workloads": loads, "configs": configs,
            "new_tokens": new_tokens, "threads": threads, "eos": eos, "pad": pad}
    (tmp / "hf_spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "specstream.pipeline.bench.spec_real", "--hf-worker",
                           str(tmp / "hf_spec.json"), str(tmp / "hf_out.json")], text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the Hugging Face benchmark process failed (exit {proc.returncode})")
    return json.loads((tmp / "hf_out.json").read_text())


# -- ours ------------------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process now (``/proc/self/status`` VmRSS), 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def parse_llama_bench(text: str) -> dict:
    """Rates of a ``llama-bench -o json`` run: ``{"tg_tok_s": text generation (``n_prompt == 0``, ``n_gen > 0``)
    tokens/s, "pp_tok_s": {"<prompt tokens>": prompt-processing tokens/s}}`` (``avg_ts`` of each record; the
    lengths are string keys, as they are after a round trip through the results' JSON).

    Raises:
        ValueError: ``text`` has no text-generation record.
    """
    records = json.loads(text[text.index("["):])
    tg = [float(r["avg_ts"]) for r in records if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not tg:
        raise ValueError("llama-bench output has no text-generation (-p 0 -n N) record")
    pp = {str(r["n_prompt"]): float(r["avg_ts"]) for r in records
          if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0}
    return {"tg_tok_s": tg[0], "pp_tok_s": pp}


def run_llama_bench(binary: Path, gguf_file: Path, new_tokens: int, threads: int = 2,
                    prompt_tokens: list[int] = ()) -> dict:
    """llama.cpp's ``llama-bench`` on ``gguf_file``: plain decoding of ``new_tokens`` (``-n``) and, for each
    length in ``prompt_tokens``, prompt processing (``-p``), with ``threads`` threads (:func:`parse_llama_bench`).

    Raises:
        RuntimeError: llama-bench exits non-zero.
    """
    lengths = ",".join(str(n) for n in sorted({0, *prompt_tokens}))
    cmd = [str(binary), "-m", str(gguf_file), "-t", str(threads), "-p", lengths, "-n", str(new_tokens), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return parse_llama_bench(proc.stdout)


def llama_end_to_end(lb: dict, prompt_tokens: int, new_tokens: int) -> float | None:
    """llama.cpp's end-to-end tokens/s for one request: ``new_tokens`` over prompt processing plus decoding
    (``prompt_tokens / pp + new_tokens / tg``, from one ``llama-bench`` run); None without a pp record of that
    length."""
    pp = lb.get("pp_tok_s", {}).get(str(prompt_tokens))
    if not pp:
        return None
    return new_tokens / (prompt_tokens / pp + new_tokens / lb["tok_s"])


def _engine(target: Path, draft: Path, tree: str | None, drafts: str | None, slots: int, max_len: int,
            adaptive: bool = True, dtype: str = "float32"):
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    # the benchmark runs the same prompts again and again (warm-up, rounds, the paired no-speculation runs): a
    # repeat would find its prompt in its slot and skip the prefill, so prefix reuse is off here and every
    # end-to-end figure keeps its prefill (``scripts/prefix_reuse_ab.py`` measures the reuse itself)
    config = EngineConfig(num_slots=slots, max_len=max_len, tree=TreeSpec.parse(tree or "1"), adaptive=adaptive,
                          prefix_reuse=False)
    return SpeculativeEngine.from_checkpoints(target, [draft] if drafts else [], ngram=drafts == "draft+ngram",
                                              config=config, dtype=dtype)


def run_ours(name: str, target: Path, draft: Path, ids: dict, loads: dict, new_tokens: int,
             max_len: int, log, adaptive: bool = True, dtype: str = "float32", bandwidth: float | None = None,
             rounds: int = 1) -> dict:
    """One configuration of ours on every workload (a warm-up first). With ``rounds`` above 1 a speculative
    configuration runs each workload ``rounds`` times, each time beside the same engine without speculation
    (``speculate=False``: the same weights, caches and scheduler; the order alternates between rounds), and
    keeps the median run. ``s_rounds`` and ``no_spec_s_rounds`` are the rounds' seconds, pair by pair (the outputs
    are the same, ``paired_identical``): on a host whose speed drifts by tens of percent within minutes, the median
    of the pairs' ratios (``vs_no_spec``, :func:`summarize`, :func:`~specstream.pipeline.bench.harness.paired_ratio`)
    is the comparison the drift does not move."""
    from specstream.kernels.quant import weight_bytes
    from specstream.stages.speculative.models.loader import return_freed_heap

    tree, drafts = CONFIGS[name]
    slots = max(len(p) for p in loads.values())
    engine = _engine(target, draft, tree, drafts, slots, max_len, adaptive, dtype)
    target_bytes = weight_bytes(engine.executor.target)
    draft_bytes = sum(weight_bytes(d.model) for d in engine.executor.drafters if hasattr(d, "model"))
    memory = {"target_weight_bytes": target_bytes, "draft_weight_bytes": draft_bytes, "rss_bytes": rss_bytes()}
    if bandwidth:
        memory["no_spec_bound_tok_s"] = bandwidth / target_bytes  # one target forward per token, weights read once
    log(f"{name} [{dtype}]: target {target_bytes / 2**30:.2f} GiB, drafts {draft_bytes / 2**30:.2f} GiB of weights, "
        f"RSS {memory['rss_bytes'] / 2**30:.2f} GiB")
    speculate = drafts is not None
    engine.generate([ids[loads[next(iter(loads))][0]]], 2, speculate=speculate)  # warm-up
    clock = engine.loop.scheduler.clock  # the clock the scheduler stamps first tokens with

    def once(prompts: list[str], spec: bool) -> dict:
        t = clock()
        reqs = engine.generate([ids[p] for p in prompts], new_tokens, speculate=spec)
        secs = clock() - t
        outs = [r.output_ids for r in reqs]
        firsts = [r.stats.first_token_s for r in reqs]
        steps = sum(r.stats.target_steps for r in reqs)
        rec = {"s": secs, "outputs": outs, "tau": sum(map(len, outs)) / max(1, steps), "target_steps": steps}
        if all(f is not None for f in firsts):
            rec["first_token_s"] = max(firsts) - t
        return rec

    paired = speculate and rounds > 1
    per = {}
    for wname, prompts in loads.items():
        runs, plain = [], []
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for spec in (order if paired else (speculate,)):
                (runs if spec == speculate else plain).append(once(prompts, spec))
        rec = median_run(runs)
        if rounds > 1:
            rec["s_rounds"] = [x["s"] for x in runs]
        if paired:  # each speculative round beside its neighbour without speculation, seconds apart
            rec["no_spec_s_rounds"] = [x["s"] for x in plain]
            rec["paired_identical"] = all(x["outputs"] == rec["outputs"] for x in runs + plain)
        rec.update(memory)
        per[wname] = rec
        tokens = sum(map(len, rec["outputs"]))
        line = f"{name} {wname}: {tokens / rec['s']:.2f} tokens/s tau={rec['tau']:.2f}"
        if paired:
            line += (f" (median of {rounds}; the same engine without speculation "
                     f"{tokens / median_run(plain)['s']:.2f} tokens/s)")
        log(line)
    del engine
    gc.collect()
    return_freed_heap()  # the next configuration's RSS: its own models, not this one's freed pages
    return per


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["s"])[(len(runs) - 1) // 2]


def host_time_per_step(target: Path, draft: Path, prompts: list[list[int]], steps: int) -> dict:
    """Step wall time and the host share (step minus model forwards) at batch ``len(prompts)`` with SpecInfer's
    21-node tree, from a ``torch.profiler`` trace: ``engine_step`` ranges around ``engine.step()`` and
    ``model_forward`` ranges around every decoder ``forward_batch`` (target and draft)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from specstream.stages.speculative.models.llama import LlamaDecoder

    new_tokens = 22 * (steps + 1)  # a step commits at most the tree's depth + 1 tokens
    engine = _engine(target, draft, PROFILE_TREE, "draft", len(prompts), max(map(len, prompts)) + new_tokens + 32)
    original = LlamaDecoder.forward_batch

    def timed_forward(self, *args, **kwargs):
        with record_function("model_forward"):
            return original(self, *args, **kwargs)

    LlamaDecoder.forward_batch = timed_forward
    try:
        for p in prompts:
            engine.add_request(engine.make_request(p, new_tokens))
        engine.step()  # the prefill step is not a decode step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                if not engine.has_work():
                    break
                with record_function("engine_step"):
                    engine.step()
    finally:
        LlamaDecoder.forward_batch = original
    events = [e for e in prof.events() if e.name in ("engine_step", "model_forward")]
    step_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == "engine_step"]
    forwards = [(e.time_range.start, e.time_range.end) for e in events if e.name == "model_forward"]
    rows = []
    for start, end in step_ranges:
        inside = sum(min(b, end) - max(a, start) for a, b in forwards if a < end and b > start)
        rows.append({"step_ms": (end - start) / 1e3, "forward_ms": inside / 1e3,
                     "host_ms": (end - start - inside) / 1e3})
    del engine
    gc.collect()
    total = sum(r["step_ms"] for r in rows) or 1.0
    return {"batch": len(prompts), "tree": PROFILE_TREE, "nodes": 21, "steps": rows,
            "mean_step_ms": total / max(1, len(rows)),
            "host_fraction": sum(r["host_ms"] for r in rows) / total}


# -- the run -----------------------------------------------------------------------------------------------------


def run(args) -> dict:
    import tempfile

    import torch

    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint

    torch.set_num_threads(args.threads)
    show = False if args.no_progress else None
    names = args.prompt_names
    loads = workloads(names, [] if args.no_batch else (getattr(args, "batch_sizes", None) or [2 * len(names)]))
    batches = [w for w, ps in loads.items() if len(ps) > 1]
    configs = args.configs
    ours_names = [c for c in configs if c in CONFIGS]
    hf_names = [c for c in configs if c in HF_CONFIGS]
    dtypes = args.dtypes or ["float32"]
    # the float32 conversion (6.7 + 2.4 GB, minutes to make) only where something runs at float32: Hugging Face,
    # the host-time profile, a float32 / bfloat16 row; a quantized run reads tokenizer and stop ids from its own
    profile = bool(args.profile_steps and batches)
    base = "float32" if hf_names or profile or {"float32", "bfloat16"} & set(dtypes) else dtypes[0]
    target = resolve_checkpoint(TARGET, show_progress=show, dtype=base).path
    draft = resolve_checkpoint(DRAFT, show_progress=show, dtype=base).path
    ids = prompt_ids(target, names)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    max_len = max(len(v) for v in ids.values()) + args.max_new_tokens + 32
    results: dict = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "dtype": "float32",
                     "new_tokens": args.max_new_tokens, "target": TARGET, "draft": DRAFT,
                     "prompts": {n: PROMPTS[n] for n in names}, "prompt_tokens": {n: len(v) for n, v in ids.items()},
                     "workloads": loads, "adaptive": not args.fixed_trees, "rounds": getattr(args, "rounds", 1), "configs": {}}
    eos = list(resolve_checkpoint(target).eos_token_ids())
    pad = eos[-1]
    if hf_names:
        with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
            hf = run_hf(target, draft, ids, loads, hf_names, args.max_new_tokens, args.threads, eos, pad, Path(tmp))
        results["hf_load_s"] = hf["load_s"]
        results["configs"].update(hf["configs"])
    machine = machine_info(args.threads)
    results["cpu"], results["read_bandwidth"] = machine["cpu"], machine["read_bandwidth"]
    from specstream.kernels.quant import native_bf16

    results["native_bf16"] = native_bf16("cpu")  # without it bf16/int8/int4 kernels convert in software
    log(f"CPU {results['cpu']}; read bandwidth {results['read_bandwidth'] / 1e9:.1f} GB/s ({args.threads} threads); "
        f"native bf16: {'yes' if results['native_bf16'] else 'no'}")
    results["dtypes"] = dtypes
    for dtype in dtypes:
        # quantized: the checkpoint converted from the GGUF file's own blocks (Q4_K -> int4), the file llama.cpp
        # runs; float32 / bfloat16: its de-quantized conversion
        dtarget = resolve_checkpoint(TARGET, show_progress=show, dtype=dtype).path
        ddraft = resolve_checkpoint(DRAFT, show_progress=show, dtype=dtype).path
        for name in ours_names:
            key = name if dtype == "float32" else f"{name}@{dtype}"
            results["configs"][key] = run_ours(name, dtarget, ddraft, ids, loads, args.max_new_tokens, max_len, log,
                                               adaptive=not args.fixed_trees, dtype=dtype,
                                               bandwidth=results["read_bandwidth"], rounds=getattr(args, "rounds", 1))
    if args.llama_bench:
        from specstream.stages.speculative.models.gguf import gguf_in_dir
        from specstream.pipeline.models_fetch import fetch_model

        gguf_file = gguf_in_dir(fetch_model(TARGET, show_progress=show))
        lb = run_llama_bench(args.llama_bench, gguf_file, args.max_new_tokens, args.threads,
                             [len(v) for v in ids.values()])
        results["llama_bench"] = {"tok_s": lb["tg_tok_s"], "pp_tok_s": lb["pp_tok_s"], "file": gguf_file.name,
                                  "threads": args.threads}
        pp = ", ".join(f"{n} prompt tokens at {r:.1f} tokens/s" for n, r in lb["pp_tok_s"].items())
        log(f"llama.cpp llama-bench {gguf_file.name}: {lb['tg_tok_s']:.2f} tokens/s plain decode "
            f"(-n {args.max_new_tokens}); prompt processing: {pp or 'none'}")
    if profile:
        batch = [ids[p] for p in loads[batches[-1]]]  # the largest batch
        results["host_time"] = host_time_per_step(target, draft, batch, args.profile_steps)
        log(f"host time per step: {100 * results['host_time']['host_fraction']:.1f}% of "
            f"{results['host_time']['mean_step_ms']:.0f} ms")
    summarize(results)
    return results


def summarize(results: dict) -> None:
    """Add tokens/s, ratios and identity flags to every (configuration, workload) entry, in place."""
    configs = results["configs"]
    ref_name = next((n for n in ("hf/greedy", "ours/no-spec") if n in configs), None)
    results["reference"] = ref_name

    def same_dtype(name: str, base: str) -> str:
        """``base`` at ``name``'s weight precision (``ours/chain-4@int4`` -> ``ours/no-spec@int4``): a quantized
        configuration is compared with the engine at the same precision, whose outputs it must equal."""
        dtype = name.partition("@")[2]
        return f"{base}@{dtype}" if dtype and f"{base}@{dtype}" in configs else base

    def alone(ref: str) -> dict:  # the reference's output of each prompt run alone
        return {results["workloads"][w][0]: configs[ref][w]["outputs"][0]
                for w, ps in results["workloads"].items() if len(ps) == 1 and w in configs[ref]}

    for name, per in configs.items():
        ref = same_dtype(name, "ours/no-spec") if "@" in name else ref_name
        reference = alone(ref) if ref in configs else None
        for wname, rec in per.items():
            tokens = sum(len(o) for o in rec["outputs"])
            rec["tokens"] = tokens
            rec["tok_s"] = tokens / rec["s"] if rec["s"] > 0 else 0.0
            first = rec.get("first_token_s")
            if first is not None and rec["s"] > first:  # every prompt prefilled: the decode rate alone
                rec["decode_tok_s"] = (tokens - len(rec["outputs"])) / (rec["s"] - first)
            if reference is not None:
                prompts = results["workloads"][wname]
                rec["identical"] = (all(out == reference.get(p) for out, p in zip(rec["outputs"], prompts))
                                    and rec.get("paired_identical", True))  # every round, with and without
    for name, per in configs.items():
        for wname, rec in per.items():
            base = configs.get(same_dtype(name, "ours/no-spec"), {}).get(wname)
            assisted = configs.get("hf/assisted", {}).get(wname)
            rec["vs_no_spec"] = ratio(rec["tok_s"], base["tok_s"] if base else None)
            if rec.get("no_spec_s_rounds"):  # the same engine without speculation, round by round (run_ours)
                rec["vs_no_spec"] = paired_ratio(rec["no_spec_s_rounds"], rec["s_rounds"])
            rec["vs_hf_assisted"] = ratio(rec["tok_s"], assisted["tok_s"] if assisted else None)


def markdown(results: dict) -> str:
    """The results as markdown tables (one per workload, then the host-time line)."""
    budget = "adaptive tree budget" if results.get("adaptive", True) else "fixed trees (adaptive budget off)"
    ref = results.get("reference") or "hf/greedy"
    if any("@" in name for name in results["configs"]):  # quantized rows: the engine alone at their precision
        ref = ("ours/no-spec at the row's dtype" if results.get("reference") is None
               else f"{ref} (quantized rows: ours/no-spec at their dtype)")
    lines = [f"Real pair ({results['target']} target, {results['draft']} draft), "
             f"{', '.join(results.get('dtypes', [results['dtype']]))}, "
             f"{results['threads']} threads, {results['new_tokens']} new tokens per request, {budget}, "
             f"{results['date']}.", ""]
    if results.get("rounds", 1) > 1:
        lines += [f"Each of ours: the median of {results['rounds']} runs per workload; each speculative run alternated "
                  f"with the same engine without speculation, and its 'vs ours/no-spec' is the median over the rounds "
                  f"of its tokens/s over its neighbour's (the same weights, seconds apart), the rounds' lowest and "
                  f"highest in brackets.", ""]
    if "cpu" in results:
        lines += [f"CPU: {results['cpu']}; measured read bandwidth {results['read_bandwidth'] / 1e9:.1f} GB/s "
                  f"(torch sum over 1 GiB, {results['threads']} threads)"
                  + ("" if "native_bf16" not in results else
                     f"; native bf16: {'yes' if results['native_bf16'] else 'no (AVX2: kernels convert in software)'}")
                  + ".", ""]
    lb = results.get("llama_bench")
    if lb:
        pp = "".join(f"; {n} prompt tokens at {r:.1f} tokens/s" for n, r in lb.get("pp_tok_s", {}).items())
        lines += [f"llama.cpp `llama-bench` on {lb['file']} ({lb['threads']} threads): plain decode "
                  f"{lb['tok_s']:.2f} tokens/s{pp}. Its end-to-end rate for a prompt is the new tokens over "
                  f"prompt processing plus decoding; ours are measured end to end (tokens/s) and after the last "
                  f"first token (decode tokens/s).", ""]
    header = ["configuration", "tokens/s", "decode tokens/s", "first token s", "tau", "vs ours/no-spec",
              "vs HF assisted", "vs llama.cpp (decode)", "vs llama.cpp (end to end)", "weights GiB (target+drafts)",
              "bound tokens/s (no-spec)", "RSS GiB", f"identical to {ref}"]
    for wname, prompts in results["workloads"].items():
        rows = []
        single = len(prompts) == 1
        lb_e2e = (llama_end_to_end(lb, results.get("prompt_tokens", {}).get(prompts[0], 0), results["new_tokens"])
                  if lb and single else None)
        if lb and single:
            rows.append(["llama.cpp/plain", f"{lb_e2e:.2f}" if lb_e2e else "–", f"{lb['tok_s']:.2f}", "–", "–",
                         "–", "–", "1.00x", "1.00x" if lb_e2e else "–", "–", "–", "–", "–"])
        for name, per in results["configs"].items():
            rec = per.get(wname)
            if rec is None:
                continue
            tau = f"{rec['tau']:.2f}" if "tau" in rec else "–"
            same = {True: "yes", False: "**no**", None: "–"}[rec.get("identical")]
            decode = rec.get("decode_tok_s")
            vs_lb = fmt_ratio(decode / lb["tok_s"]) if lb and single and decode else "–"
            vs_lb_e2e = fmt_ratio(rec["tok_s"] / lb_e2e) if lb_e2e else "–"
            gib = (f"{(rec['target_weight_bytes'] + rec['draft_weight_bytes']) / 2**30:.2f}"
                   if "target_weight_bytes" in rec else "–")
            bound = f"{rec['no_spec_bound_tok_s']:.2f}" if "no_spec_bound_tok_s" in rec else "–"
            rss = f"{rec['rss_bytes'] / 2**30:.2f}" if rec.get("rss_bytes") else "–"
            first = f"{rec['first_token_s']:.2f}" if rec.get("first_token_s") is not None else "–"
            vs_plain = fmt_ratio(rec["vs_no_spec"])
            if rec.get("no_spec_s_rounds"):  # the rounds' spread
                pairs = [b / t for b, t in zip(rec["no_spec_s_rounds"], rec["s_rounds"])]
                vs_plain += f" ({min(pairs):.2f}-{max(pairs):.2f})"
            rows.append([name, f"{rec['tok_s']:.2f}", f"{decode:.2f}" if decode else "–", first, tau,
                         vs_plain, fmt_ratio(rec["vs_hf_assisted"]), vs_lb, vs_lb_e2e, gib,
                         bound, rss, same])
        lines += [f"**{wname}** ({', '.join(prompts)})", "", *md_table(header, rows), ""]
    host = results.get("host_time")
    if host:
        lines.append(f"Host time per step at batch {host['batch']} with {host['nodes']}-node trees: "
                     f"{100 * host['host_fraction']:.1f}% of a {host['mean_step_ms']:.0f} ms step "
                     f"({len(host['steps'])} steps profiled).")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    loads = list(results["workloads"])
    names = list(results["configs"])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(loads)), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(loads))]
        ys = [results["configs"][name].get(w, {}).get("tok_s", 0.0) for w in loads]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))])
    ax.set_xticklabels(loads)
    llama = results.get("llama_bench")
    if llama and llama.get("tok_s"):  # llama.cpp's plain decode of the same GGUF, the anchor of the run
        ax.axhline(llama["tok_s"], color="black", linestyle="--", linewidth=1, label="llama.cpp, decode only (no prompt)")
    ax.set_ylabel("tokens/s (end to end)")
    dtypes = ",".join(results.get("dtypes") or ["float32"])
    ax.set_title(f"Qwen2.5-Coder 1.5B/0.5B ({dtypes}), {results['threads']} threads, {results['new_tokens']} new "
                 f"tokens; {results.get('cpu', '')}")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path, dpi=120)


def write(results: dict, out: Path) -> None:
    stem = "bench_spec_real" if results.get("adaptive", True) else "bench_spec_real_fixed"
    write_results(out, stem, results, markdown=markdown(results), plot=plot, indent=1)


def main(args) -> int:
    """``specstream bench spec --real`` (arguments from the CLI's ``bench spec`` parser)."""
    if args.table_from:
        results = json.loads(Path(args.table_from).read_text())
        print(markdown(results))
        return 0
    if args.quick:
        args.prompt_names = args.prompt_names or ["code"]
        args.max_new_tokens = min(args.max_new_tokens, 4)
        args.profile_steps = min(args.profile_steps, 2)
    args.prompt_names = args.prompt_names or list(PROMPTS)
    args.configs = args.configs or [*HF_CONFIGS, *CONFIGS]
    unknown = [c for c in args.configs if c not in CONFIGS and c not in HF_CONFIGS]
    bad_prompts = [p for p in args.prompt_names if p not in PROMPTS]
    if unknown or bad_prompts:
        print(f"error: unknown configurations {unknown} / prompts {bad_prompts}; configurations: "
              f"{', '.join([*HF_CONFIGS, *CONFIGS])}; prompts: {', '.join(PROMPTS)}", file=sys.stderr)
        return 2
    results = run(args)
    write(results, args.out)
    print(markdown(results))
    flags = [rec.get("identical") for per in results["configs"].values() for rec in per.values()]
    return 0 if all(f is not False for f in flags) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--real`` options of ``specstream bench spec``."""
    parser.add_argument("--real", action="store_true",
                        help="the real Qwen2.5-Coder 1.5B/0.5B pair against Hugging Face (fetched and converted on "
                             "first use)")
    parser.add_argument("--prompt-set", dest="prompt_names", type=lambda s: [x for x in s.split(",") if x],
                        default=None, help=f"--real: prompts, comma-separated (default: all of {', '.join(PROMPTS)})")
    parser.add_argument("--configs", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help=f"--real: configurations, comma-separated (default: all of "
                             f"{', '.join([*HF_CONFIGS, *CONFIGS])}; with --structured: constrained/no-spec, "
                             f"constrained/grammar-only, constrained/specinfer, and constrained/grammar+ngram when "
                             f"named)")
    parser.add_argument("--no-batch", action="store_true", help="--real: skip the batch workloads")
    parser.add_argument("--fixed-trees", action="store_true",
                        help="--real: our engines draft the configured tree every step (adaptive budget off); "
                             "results go to bench_spec_real_fixed.*")
    parser.add_argument("--threads", type=int, default=2, help="--real: torch intra-op threads (default 2)")
    parser.add_argument("--dtypes", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="--real: weight precisions of our configurations, comma-separated (float32, bfloat16, "
                             "int8, int4, int4-g64; default float32); each prints its weight bytes, bound and RSS")
    parser.add_argument("--llama-bench", type=Path, default=None, metavar="PATH",
                        help="--real: llama.cpp's llama-bench binary, run on the same target GGUF (2 threads, "
                             "-p 0 -n N) as the anchor row")
    parser.add_argument("--profile-steps", type=int, default=8,
                        help="--real: decode steps profiled for the host time per step (0: none)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--real: runs of each workload per configuration, medians reported; above 1, each "
                             "speculative run alternates with the same engine without speculation, the baseline "
                             "of its 'vs ours/no-spec' (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="--real: no fetch/convert progress bars")
    parser.add_argument("--structured", action="store_true",
                        help="--real: JSON-schema workloads (a code-review object, a caption-like object), "
                             "constrained + speculative vs constrained alone (pipeline/bench/structured.py)")
    parser.add_argument("--table-from", type=Path, default=None,
                        help="--real: print the markdown tables of an earlier results JSON and exit")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--hf-worker":
        sys.exit(hf_worker(sys.argv[2], sys.argv[3]))
    print("usage: specstream bench spec --real [options]", file=sys.stderr)
    sys.exit(2)
