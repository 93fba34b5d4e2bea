"""``specstream bench subtitles``: the streaming recognizer on espeak-ng recordings whose text is known.

For each model (tiny.en, whisper-base), recording (the 10-sentence espeak-ng recording; the 62-s bulletin with
pauses and numbers, ``tests/live_fixtures.py``), agreement span and pace (real time, all at once):

1. a replay on a simulated clock (chunks arrive at the pace, passes take their measured compute time): WER of the
   finals, final latency p50/p95 (wall: from the arrival of the audio at a final's end; audio: the position of the
   pass that committed it minus that end, which no machine speed changes), the share of the speech that reached a
   final (every 0.1 s of each sentence inside some final's span, 0.5-s tolerance: must be 1.0), the longest time
   between consecutive finals during speech, passes and real-time factor;
2. drafts off (same finals, tested): target decoder steps per token with and without hypothesis drafts;
3. the cost of the log-probabilities the silence rule needs: the same windows decoded with and without them;
4. faster-whisper (beam 1) on the whole file: the WER baseline; our offline ``transcribe`` too;
5. optionally 1..N concurrent streams at real-time pace on the wall clock sharing one engine.

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
from dataclasses import replace
from pathlib import Path

import numpy as np

from specstream.pipeline.bench.harness import (machine_info, machine_line, pyplot, save_figure, tests_dir_on_path,
                                               write_results)


def _pass_mean(passes) -> float | None:
    walls = [p.wall_s for p in passes if p.wall_s > 0]
    return round(float(np.mean(walls)), 3) if walls else None


def speech_share(spans: list[tuple[float, float]], finals: list[tuple[float, float]], tolerance_s: float = 0.5,
                 step_s: float = 0.1) -> float:
    """Share of the speech (sentence spans, sampled every ``step_s``) inside some final's span +- tolerance."""
    pts = [t for a, b in spans for t in np.arange(a, b, step_s)]
    if not pts:
        return 1.0
    hit = sum(1 for t in pts if any(s - tolerance_s <= t <= e + tolerance_s for s, e in finals))
    return round(hit / len(pts), 4)


def max_final_gap(finals, speech_start_s: float, speech_end_s: float, audio: bool = False) -> float | None:
    """Longest time between consecutive finals (from the start of speech) while speech went on: on the recognizer's
    clock, or with ``audio`` in audio positions of the committing passes (what no machine speed changes)."""
    if audio:
        times = [speech_start_s] + [f.position_s for f in finals if f.position_s is not None
                                    and f.position_s <= speech_end_s]
    else:
        times = [f.emitted_s for f in finals if f.end_s <= speech_end_s]
    return round(float(max(np.diff(times))), 2) if len(times) > 1 else None


def max_pending_speech_gap(finals, spans: list[tuple[float, float]], speech_end_s: float,
                           tolerance_s: float = 0.5) -> float | None:
    """Longest audio a final was owed while speech was pending (what ``max_final_gap_s`` bounds): between two
    consecutive finals, from the later of the first one's commit position and the first speech after its end (the
    recording's spoken ``spans``; a span reaching at most ``tolerance_s`` past a final's end counts as covered by
    it, as in :func:`speech_share`: Whisper's timestamps and the spans' -60 dBFS edges differ by a few tenths) to
    the next one's commit position; the first final is owed from the start of speech. Unlike
    :func:`max_final_gap` (audio), a pause with nothing left to commit does not count: the bulletin has pauses of
    up to 3 s between sentences, which alone make a gap of that length."""
    fs = sorted((f for f in finals if f.position_s is not None and f.position_s <= speech_end_s),
                key=lambda f: f.position_s)
    if not fs or not spans:
        return None
    gaps, owed_from = [], spans[0][0]
    for f in fs:
        gaps.append(max(0.0, f.position_s - owed_from))
        after = [max(a, f.end_s) for a, b in spans if b > f.end_s + tolerance_s]  # speech after this final
        owed_from = max(f.position_s, min(after)) if after else float("inf")
    return round(max(gaps), 2)


async def realtime_streams(model, audio: np.ndarray, n: int, chunk_s: float = 0.5, config=None,
                           max_lag_s: float = 3.0) -> dict:
    """``n`` streams of ``audio`` at real-time pace on the wall clock, sharing one :class:`SpeechService` (one
    engine: windows of different streams are batched in the encoder and the decoder), as ``n`` WebSocket
    sessions would. Stream ``k`` starts ``k * chunk_s / n`` s after the first, so their passes interleave.
    Each chunk is stamped with its scheduled arrival time, so final latencies include any delay in inserting it.

    A stream keeps real time when its last chunk is decoded (``finish`` returned) within ``max_lag_s`` of its
    arrival. ``max_backlog_s`` is the most audio a pass found undecoded. A timing claim: only meaningful on a
    quiet machine.

    Returns: per-stream and pooled figures (final latency p50/p95 ms, lag s, passes, mean pass s, max backlog s,
    the finals' (start_s, end_s), the audio position decoded to).
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
                "final_times": [(s.start_s, s.end_s) for s in rec.finals], "decoded_until_s": rec.decoded_until_s,
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


def logprobs_cost(model, windows: list[np.ndarray], prompts: list[tuple[tuple[int, ...], tuple[int, ...]]],
                  repeats: int = 2) -> dict:
    """Decode the same windows (undrafted, timestamps, same prompts and prefixes) with and without per-token
    log-probabilities, alternating, in one run: seconds per window each way and the relative cost."""
    kvs = model.decoder.project(model.encode(np.stack(windows)))
    times = {True: [], False: []}
    tokens = {}
    for r in range(repeats):
        for lp in (False, True) if r % 2 == 0 else (True, False):
            engine = model.new_engine("none", num_slots=1)
            t0 = time.perf_counter()
            res = model.decode(engine, kvs, speculate=False, timestamps=True, logprobs=lp,
                               previous=[h for h, _ in prompts], prefixes=[p for _, p in prompts], max_new_tokens=160)
            times[lp].append(time.perf_counter() - t0)
            tokens[lp] = [x.tokens for x in res]
    on, off = min(times[True]), min(times[False])
    return {"windows": len(windows), "decode_s_with_logprobs": round(on, 3), "decode_s_without": round(off, 3),
            "relative_cost": round(on / off - 1.0, 4), "identical_tokens": tokens[True] == tokens[False]}


def _summary(res, rec, wer, speech_end_s: float) -> dict:
    lat = [s.latency_ms for s in res.finals]
    audio_lat = [max(0.0, s.position_s - s.end_s) for s in res.finals if s.position_s is not None]
    toks = sum(len(p.raw_tokens) + (p.finish_reason == "eos") for p in res.passes)
    steps = sum(p.target_steps for p in res.passes)

    def pct(x, q):
        return round(float(np.percentile(x, q)), 3) if x else None

    return {
        "wer": round(wer(rec.text, res.text), 3),
        "speech_share": speech_share(rec.spans, [(f.start_s, f.end_s) for f in res.finals]),
        "final_latency_s_p50": pct([x / 1000 for x in lat], 50), "final_latency_s_p95": pct([x / 1000 for x in lat], 95),
        "audio_latency_s_p50": pct(audio_lat, 50), "audio_latency_s_p95": pct(audio_lat, 95),
        "max_final_gap_s": max_final_gap(res.finals, rec.spans[0][0], speech_end_s),
        "max_final_gap_audio_s": max_final_gap(res.finals, rec.spans[0][0], speech_end_s, audio=True),
        "max_pending_speech_gap_s": max_pending_speech_gap(res.finals, rec.spans, speech_end_s),
        "finals": len(res.finals), "passes": len(res.passes), "pass_s_mean": _pass_mean(res.passes),
        "skipped_positions": res.skipped_positions,
        "rtf": round(sum(p.wall_s for p in res.passes) / rec.duration_s, 3),
        "target_steps_per_token": round(steps / max(1, toks), 3),
        "decoded_until_s": round(res.decoded_until_s, 3), "text": res.text,
    }


def bench_subtitles_main(argv: list[str]) -> int:
    from specstream.helptext import doc_help

    parser = argparse.ArgumentParser(prog="specstream bench subtitles", description=doc_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,whisper-base", help="comma list (tiny.en, whisper-base, dirs)")
    parser.add_argument("--recordings", default="espeak,bulletin", help="comma list: espeak, bulletin")
    parser.add_argument("--spans", default="0,2.5", help="agreement spans (s), comma list")
    parser.add_argument("--paces", default="1,inf", help="paces: 1 (real time), inf (all at once), comma list")
    parser.add_argument("--hop-s", type=float, default=None, help="audio between passes (default StreamConfig's)")
    parser.add_argument("--catch-up-s", default=None,
                        help="StreamConfig.catch_up_s values to compare, comma list of seconds and 'off' (default: "
                             "the StreamConfig default alone)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dtypes", default="float32",
                        help="Whisper weight precisions, comma list (float32, bfloat16, int8, int4, auto; as serve "
                             "--speech-dtype): each model runs at each, its rows labelled 'MODEL DTYPE' but float32")
    parser.add_argument("--streams", default="", help="concurrent real-time stream counts (comma list; empty: skip)")
    parser.add_argument("--no-faster-whisper", action="store_true",
                        help="skip the faster-whisper reference transcription of each recording")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench_subtitles.json and .png")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tests_dir_on_path()
    from live_fixtures import SCRIPT, compose, long_recording, wer

    from specstream.stages.speech import SpeechModel, transcribe
    from specstream.stages.streaming import SpeechService, StreamConfig, replay

    tmp = Path(tempfile.mkdtemp(prefix="bench-subtitles-"))
    recs = {}
    for name in [x for x in args.recordings.split(",") if x]:
        if name == "espeak":
            recs[name] = compose(tmp, SCRIPT, [0.5] * len(SCRIPT))
        elif name == "bulletin":
            recs[name] = long_recording(tmp)
        else:
            parser.error(f"unknown recording {name!r}")
    spans = [float(x) for x in args.spans.split(",") if x.strip()]
    paces = [None if x.strip() == "inf" else float(x) for x in args.paces.split(",") if x.strip()]
    base = StreamConfig()
    hop = args.hop_s or base.hop_s
    try:
        catch_ups = [base.catch_up_s] if args.catch_up_s is None else [
            None if x.strip().lower() in ("off", "none") else float(x) for x in args.catch_up_s.split(",") if x.strip()]
        for c in catch_ups:
            StreamConfig(catch_up_s=c)  # ValueError below 0
    except ValueError as exc:
        parser.error(f"--catch-up-s: {exc}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = machine_info(torch.get_num_threads())
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    log(f"{machine_line(info)}; Whisper weights {', '.join(dtypes)}")
    out: dict = {"date": datetime.date.today().isoformat(), "cpu": info["cpu"],
                 "read_bandwidth": info["read_bandwidth"], "dtypes": dtypes,
                 "torch_threads": torch.get_num_threads(),
                 "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0], "hop_s": hop,
                 "default_agree_span_s": base.agree_span_s, "max_final_gap_setting_s": base.max_final_gap_s,
                 "default_catch_up_s": "off" if base.catch_up_s is None else base.catch_up_s,
                 "recordings": {k: round(r.duration_s, 2) for k, r in recs.items()}, "runs": [], "models": {}}
    for model_name, dtype in [(x, d) for x in args.models.split(",") if x for d in dtypes]:
        sm = SpeechModel.load(model_name, dtype=dtype)
        m: dict = {"model": model_name, "dtype": dtype, "offline": {}, "faster_whisper": {}, "drafts": {},
                   "logprobs_cost": None}
        first_dtype = dtype == dtypes[0]  # faster-whisper's reference once per model
        out["models"][_label(model_name, dtype)] = m
        for rname, rec in recs.items():
            t0 = time.perf_counter()
            m["offline"][rname] = {"wer": round(wer(rec.text, transcribe(rec.audio, sm, language="en").text), 3),
                                   "wall_s": round(time.perf_counter() - t0, 2)}
            if not args.no_faster_whisper and first_dtype:
                m["faster_whisper"][rname] = _faster_whisper_wer(sm, rec, wer)
            log(f"{_label(model_name, dtype)} {rname}: offline WER {m['offline'][rname]['wer']}, faster-whisper "
                f"{m['faster_whisper'].get(rname)}")
            speech_end = rec.spans[-1][1]
            for span, pace, catch_up in [(a, b, c) for a in spans for b in paces for c in catch_ups]:
                cfg = StreamConfig(hop_s=hop, agree_span_s=span, catch_up_s=catch_up)
                res = asyncio.run(_replay(SpeechService, sm, rec.audio, cfg, pace, replay))
                row = {"model": model_name, "dtype": dtype, "recording": rname, "agree_span_s": span,
                       "pace": "inf" if pace is None else pace,
                       "catch_up_s": "off" if catch_up is None else catch_up,
                       **_summary(res, rec, wer, speech_end)}
                out["runs"].append(row)
                log(f"  span {span:g} pace {row['pace']} catch-up {row['catch_up_s']}: WER {row['wer']}, "
                    f"share {row['speech_share']}, "
                    f"p50/p95 {row['final_latency_s_p50']}/{row['final_latency_s_p95']} s (audio "
                    f"{row['audio_latency_s_p50']}/{row['audio_latency_s_p95']} s), max gap "
                    f"{row['max_final_gap_s']} s (audio {row['max_final_gap_audio_s']} s, pending speech "
                    f"{row['max_pending_speech_gap_s']} s), "
                    f"{row['target_steps_per_token']} steps/token")
                if span == spans[0] and pace is None and rname not in m["drafts"]:
                    # drafts against none at the fixed positions (the catch-up would make the two runs' pass
                    # positions, and so their finals, depend on their speeds)
                    fixed = StreamConfig(hop_s=hop, agree_span_s=span, catch_up_s=None)
                    drafted = row
                    if catch_up is not None:
                        res = asyncio.run(_replay(SpeechService, sm, rec.audio, fixed, None, replay))
                        drafted = _summary(res, rec, wer, speech_end)
                    plain = asyncio.run(_replay(SpeechService, sm, rec.audio, replace(fixed, speculate=False),
                                                None, replay))
                    p = _summary(plain, rec, wer, speech_end)
                    m["drafts"][rname] = {"agree_span_s": span,
                                          "steps_per_token_drafted": drafted["target_steps_per_token"],
                                          "steps_per_token_undrafted": p["target_steps_per_token"],
                                          "identical_finals": [f.text for f in plain.finals] == [
                                              f.text for f in res.finals]}
                    if m["logprobs_cost"] is None:
                        ws = [x for x in res.passes if x.window is not None][:8]
                        if ws:
                            m["logprobs_cost"] = logprobs_cost(sm, [x.window for x in ws],
                                                               [(x.history, x.prefix) for x in ws])
                    log(f"  drafts: {m['drafts'][rname]}; logprobs cost {m['logprobs_cost']}")
        if args.streams:
            rec = next(iter(recs.values()))
            m["realtime_streams"] = []
            for n in [int(x) for x in args.streams.split(",") if x.strip()]:
                r = asyncio.run(realtime_streams(sm, rec.audio, n,
                                                 config=StreamConfig(hop_s=hop, catch_up_s=catch_ups[0])))
                m["realtime_streams"].append(r)
                log(f"  {n} real-time stream(s): keeps up {r['keeps_real_time']} (lag {r['max_lag_s']} s), p95 "
                    f"{r['final_latency_ms_p95']} ms")
    out["loadavg_end"] = os.getloadavg()[0]
    out["requirements"] = _requirements(out)
    print(json.dumps(out, indent=1))
    if args.out is not None:
        write_results(args.out, "bench_subtitles", out, plot=plot, indent=1)
    return 0


async def _replay(service_cls, sm, audio, cfg, pace, replay):
    svc = service_cls(sm, num_slots=2)
    try:
        return await replay(svc, audio, 0.5, replace(cfg, keep_windows=True), pace=pace)
    finally:
        await svc.stop()


def _faster_whisper_wer(sm, rec, wer) -> dict | None:
    """faster-whisper on the same CTranslate2 weights and the whole file (beam 1, temperature 0): with its timestamp
    mode and without timestamps."""
    src = (sm.checkpoint.path / "CONVERTED_FROM").read_text().split("\n")[0] \
        if (sm.checkpoint.path / "CONVERTED_FROM").exists() else None
    if src is None or not Path(src).is_dir():
        return None
    from faster_whisper import WhisperModel

    fw = WhisperModel(src, device="cpu", compute_type="float32", cpu_threads=max(1, (os.cpu_count() or 2) // 2))
    res = {}
    for name, extra in (("timestamps", {}), ("without_timestamps", {"without_timestamps": True})):
        segs, _ = fw.transcribe(rec.audio, beam_size=1, temperature=0.0, condition_on_previous_text=False,
                                vad_filter=False, language="en", **extra)
        res[name] = round(wer(rec.text, " ".join(s.text for s in segs)), 3)
    return res


def _label(model: str, dtype: str | None) -> str:
    """A model's name in the run's tables: ``tiny.en``, or ``tiny.en int4`` at another precision than float32."""
    return model if dtype in (None, "float32") else f"{model} {dtype}"


def _requirements(out: dict) -> dict:
    """What the runs must show, evaluated (None where the run lacks the data): no lost speech, the longest gap
    between finals at the default, latency and WER of tiny.en at each setting, base against tiny.en."""
    runs = out["runs"]
    req: dict = {"no_lost_speech": all(r["speech_share"] >= 1.0 for r in runs) if runs else None}
    cu = out.get("default_catch_up_s", "off")  # (runs written before the setting: every row is "off")
    default = [r for r in runs if r["agree_span_s"] == out["default_agree_span_s"] and r["pace"] == 1.0
               and r.get("catch_up_s", cu) == cu]
    gaps = [r["max_final_gap_audio_s"] for r in default if r["max_final_gap_audio_s"] is not None]
    req["max_final_gap_audio_s_at_default"] = max(gaps) if gaps else None
    pending = [r["max_pending_speech_gap_s"] for r in default if r.get("max_pending_speech_gap_s") is not None]
    req["max_pending_speech_gap_s_at_default"] = max(pending) if pending else None
    tiny = [r for r in runs if r["model"] in ("tiny.en", "whisper-tiny.en") and r["pace"] == 1.0]
    fw = next((m["faster_whisper"] for m in out["models"].values()
               if m.get("model") == "tiny.en" and m.get("faster_whisper")), {})
    best = []
    for r in tiny:
        ref = fw.get(r["recording"])
        if ref:
            bound = min(ref.values()) + 0.10
            best.append({"recording": r["recording"], "agree_span_s": r["agree_span_s"],
                         "catch_up_s": r.get("catch_up_s"), "wer": r["wer"],
                         "wer_bound": round(bound, 3), "p95_s": r["final_latency_s_p95"],
                         "met": r["wer"] <= bound and (r["final_latency_s_p95"] or 1e9) <= 2.5})
    req["tiny_latency_and_accuracy"] = best or None
    pairs = []
    for r in runs:
        if r["model"] == "whisper-base":
            t = next((x for x in runs if x["model"] == "tiny.en" and x["recording"] == r["recording"]
                      and x["agree_span_s"] == r["agree_span_s"] and x["pace"] == r["pace"]
                      and x.get("dtype") == r.get("dtype") and x.get("catch_up_s") == r.get("catch_up_s")), None)
            if t is not None:
                pairs.append({"dtype": r.get("dtype"), "recording": r["recording"],
                              "agree_span_s": r["agree_span_s"], "pace": r["pace"],
                              "catch_up_s": r.get("catch_up_s"),
                              "wer_tiny": t["wer"], "wer_base": r["wer"],
                              "reduction": round(1 - r["wer"] / t["wer"], 3) if t["wer"] else None,
                              "p95_base_s": r["final_latency_s_p95"]})
    req["base_vs_tiny"] = pairs or None
    return req


def plot(out: dict, path: Path) -> None:
    """WER against p95 final latency for each model, span and recording (real-time pace)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(_label(r["model"], r.get("dtype")), r["recording"]) for r in out["runs"]})
    for (model, rname), marker in zip(keys, "os^vD<>*"):
        pts = [r for r in out["runs"] if _label(r["model"], r.get("dtype")) == model and r["recording"] == rname
               and r["pace"] == 1.0 and r["final_latency_s_p95"] is not None]
        if not pts:
            continue
        ax.plot([r["final_latency_s_p95"] for r in pts], [r["wer"] for r in pts], marker=marker, ls="",
                label=f"{model}, {rname}")
        for r in pts:
            ax.annotate(f"span {r['agree_span_s']:g}, catch-up {r.get('catch_up_s', 'off')}",
                        (r["final_latency_s_p95"], r["wer"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8, rotation=20)
    ax.axvline(2.5, color="grey", ls=":", label="p95 2.5 s")
    xs = [r["final_latency_s_p95"] for r in out["runs"] if r["pace"] == 1.0 and r["final_latency_s_p95"]]
    if xs and max(xs) > 8 * min(xs):  # a stream that fell behind next to ones that kept up
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100, 200) if min(xs) / 2 <= t <= max(xs) * 2]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("final latency p95 (s, real-time pace)")
    ax.set_ylabel("WER of finals")
    ax.set_title(f"live subtitles ({out['torch_threads']} torch threads, hop {out['hop_s']:g} s)")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)
