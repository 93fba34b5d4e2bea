"""A/B of prompt-prefix reuse on the real Qwen2.5-Coder pair, in one process.

``python scripts/prefix_reuse_ab.py [--dtype int4] [--rounds 4] [--new-tokens 40] [--configs no-spec,chain-2]``

Four different chat prompts (``specstream bench spec --real``'s code, prose, caption and repetitive), each under
the checkpoint's chat template, so they share its system turn, run one after another on a one-slot engine: what a
user's sequential requests look like. "on" is the engine with ``EngineConfig.prefix_reuse`` (the default), "off"
the same loaded weights with it off; each round runs both, the order alternating. Per configuration it prints the
CPU and its read bandwidth, the median over rounds of the four requests' total seconds and of their time to first
token, the median of the per-round ratios (off / on), the prompt tokens reused per request, and whether every
output of "on" equals "off"'s. There is no llama.cpp row: the A/B compares the engine with itself. Needs the real
pair (``specstream models fetch``). Only for reading: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

TREES = {"no-spec": None, "chain-2": "1,1", "chain-4": "1,1,1,1", "specinfer": "1,1,3,1,1,1,1,1"}


def main() -> int:
    from specstream.modalities.text import chat_prompt_ids
    from specstream.pipeline import models_fetch
    from specstream.pipeline.bench.harness import machine_info, machine_line
    from specstream.pipeline.bench.spec_real import DRAFT, PROMPTS, TARGET
    from specstream.stages.serving import _eos_ids
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="no-spec,chain-2", help=f"of {', '.join(TREES)}")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models_fetch.install()  # registered model names resolve (fetched on first use), as in the CLI
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in TREES]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose among {', '.join(TREES)}")
    tckpt = resolve_checkpoint(TARGET)
    target, draft = tckpt.path, resolve_checkpoint(DRAFT).path
    eos = _eos_ids(tckpt)
    prompts = {name: chat_prompt_ids(target, text) for name, text in PROMPTS.items()}
    ids = list(prompts.values())
    shared = 0
    while all(len(p) > shared and p[shared] == ids[0][shared] for p in ids):
        shared += 1
    machine = machine_info(args.threads)
    print(machine_line(machine))
    print(f"{len(ids)} prompts of {', '.join(str(len(p)) for p in ids)} tokens; shared prefix {shared} tokens")
    max_len = max(map(len, ids)) + args.new_tokens + 64
    loaded = SpeculativeEngine.from_checkpoints(target, [draft], config=EngineConfig(num_slots=1, max_len=max_len),
                                                dtype=args.dtype)
    loaded.eos_token_ids = tuple(eos)  # Qwen ends a turn with <|im_end|> (the generation config's), as served
    results: dict = {"cpu": machine["cpu"], "read_bandwidth_gbs": machine["read_bandwidth"] / 1e9,
                     "threads": args.threads, "dtype": args.dtype, "new_tokens": args.new_tokens,
                     "prompt_tokens": [len(p) for p in ids], "shared_prefix": shared, "configs": {}}
    for cname in configs:
        tree = TREES[cname]
        engines = {}
        for arm, reuse in (("on", True), ("off", False)):
            cfg = EngineConfig(num_slots=1, max_len=max_len, tree=TreeSpec.parse(tree or "1"), prefix_reuse=reuse)
            engines[arm] = loaded.reconfigured(cfg, drafts=tree is not None)

        def run(arm):
            eng = engines[arm]
            total, ttft, reused, outs = 0.0, 0.0, [], []
            for p in ids:
                r0 = eng.executor.prefix_reused_tokens
                t0 = time.perf_counter()
                first = None
                out = []
                for chunk in eng.stream(p, args.new_tokens):
                    if first is None:
                        first = time.perf_counter() - t0
                    out.extend(chunk)
                total += time.perf_counter() - t0
                ttft += first or 0.0
                reused.append(eng.executor.prefix_reused_tokens - r0)
                outs.append(out)
            return total, ttft, reused, outs

        run("on"), run("off")  # warm-up: each engine's slot then holds a previous prompt, as in steady use
        rec = {"on": [], "off": [], "ratio": [], "ttft_ratio": [], "identical": True}
        for r in range(args.rounds):
            for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                total, ttft, reused, outs = run(arm)
                rec[arm].append({"s": total, "ttft_s": ttft, "reused": reused, "outputs": outs})
            on, off = rec["on"][-1], rec["off"][-1]
            rec["ratio"].append(off["s"] / on["s"])
            rec["ttft_ratio"].append(off["ttft_s"] / on["ttft_s"])
            rec["identical"] &= on["outputs"] == off["outputs"]
        results["configs"][cname] = rec
        med = lambda arm, key: statistics.median(x[key] for x in rec[arm])  # noqa: E731
        print(f"{cname}: 4 requests {med('on', 's'):.2f} s with reuse, {med('off', 's'):.2f} s without "
              f"(off/on {statistics.median(rec['ratio']):.3f}x, range {min(rec['ratio']):.3f}-"
              f"{max(rec['ratio']):.3f}); time to first token, summed: {med('on', 'ttft_s'):.3f} s against "
              f"{med('off', 'ttft_s'):.3f} s ({statistics.median(rec['ttft_ratio']):.2f}x); reused per request "
              f"{rec['on'][-1]['reused']}; identical outputs: {rec['identical']}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0 if all(c["identical"] for c in results["configs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
