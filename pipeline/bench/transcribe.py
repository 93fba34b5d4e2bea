"""``specstream bench transcribe``: offline transcription and live-style passes, ours with speculation on and off,
beside faster-whisper on the same CTranslate2 weights, in one run.

Per model (tiny.en, whisper-base) and espeak-ng recording whose text is known (the 10-sentence recording and the
62-s bulletin of ``tests/live_fixtures.py``):

1. **transcribe**: ``specstream.stages.speech.transcribe`` (timestamps, Silero VAD, beam 1, temperature 0, no
   previous text) with speculation off (``drafter none``) and on (the default ``ngram`` drafter), optionally in
   bfloat16 too (``--dtypes``); faster-whisper ``transcribe`` with the same options in float32 and int8
   (``compute_type``; its own Silero VAD). Each configuration is warmed once, then the configurations run in
   alternating rounds (``--rounds``, the order rotated every round) so the machine's load falls on all of them
   alike. Reported: WER (jiwer, on normalised text), real-time factor (wall / audio seconds; loading excluded),
   the median over rounds, and ratios against ours-off and faster-whisper int8 measured in the same rounds.
2. **passes**: what a live recognizer decodes: a window growing by ``--hop-s`` up to ``--pass-window-s`` of the
   latest audio, each decoded with timestamps, drafted (spec on) from the previous pass's tokens by the temporal
   drafter (the hypothesis drafter first, then n-grams). Encoder work is the same either way and is excluded: the
   decode wall time of all passes, on vs off, alternating, and whether every pass gave the same tokens.
3. **profile**: one more transcription per configuration of ours (each precision) with the encoder, the
   decoder's forwards and the rest (drafting, logits processors, verification, commit, scheduling: host time)
   timed apart, per target step.

Prints the CPU model and one JSON object; ``--out DIR`` writes ``bench_transcribe.json`` and
``bench_transcribe.md`` there (docs/benchmarks.md quotes the table). The machine's load is recorded (load average
at start and end): timings are only comparable within one run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specstream.pipeline.bench.harness import (machine_info, md_table, paired_ratio, tests_dir_on_path,
                                               write_results)


def profile_transcribe(sm, audio: np.ndarray, speculate: bool) -> dict:
    """One transcription with the encoder, the decoder forwards of the decode loop and the rest of that loop
    (drafting, logits processors, verification, commit, scheduling: host time) timed apart (seconds, and
    milliseconds per target step). The wrappers are set on the instances and removed afterwards."""
    from specstream.stages.speech import transcribe

    spent = {"encoder_s": 0.0, "decode_s": 0.0, "decoder_forward_s": 0.0}
    inside = [False]

    def timed(fn, key, only_in_decode=False):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if only_in_decode and not inside[0]:  # the no-speech probe's forward is not decode work
                return fn(*a, **k)
            outer = key == "decode_s"
            inside[0] = inside[0] or outer
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
                if outer:
                    inside[0] = False
        return wrapper

    sm.encode = timed(sm.encode, "encoder_s")
    sm.decode = timed(sm.decode, "decode_s")
    sm.decoder.forward_batch = timed(sm.decoder.forward_batch, "decoder_forward_s", True)
    try:
        t0 = time.perf_counter()
        res = transcribe(audio, sm, language="en", speculate=speculate, drafter="ngram" if speculate else "none")
        wall = time.perf_counter() - t0
    finally:
        for obj, attr in ((sm, "encode"), (sm, "decode"), (sm.decoder, "forward_batch")):
            obj.__dict__.pop(attr, None)
    steps = max(1, res.info.target_steps)
    dec, fwd = spent["decode_s"], spent["decoder_forward_s"]
    return {"wall_s": round(wall, 3), "encoder_s": round(spent["encoder_s"], 3), "decode_s": round(dec, 3),
            "decoder_forward_s": round(fwd, 3), "target_steps": res.info.target_steps, "tokens": res.info.tokens,
            "forward_ms_per_step": round(1000 * fwd / steps, 2),
            "decode_host_ms_per_step": round(1000 * max(0.0, dec - fwd) / steps, 2),
            "other_s": round(wall - dec - spent["encoder_s"], 3)}


def live_passes(sm, audio: np.ndarray, hop_s: float, window_s: float) -> list[tuple[np.ndarray, int]]:
    """The windows a live recognizer decodes: every ``hop_s`` of audio, the latest ``window_s`` (log-mel 30-s windows
    and their content frames)."""
    from specstream.modalities.audio import SAMPLE_RATE, log_mel
    from specstream.stages.speech import _clip_window

    out = []
    hop, win = int(hop_s * SAMPLE_RATE), int(window_s * SAMPLE_RATE)
    for end in range(hop, len(audio) + hop, hop):
        end = min(end, len(audio))
        chunk = audio[max(0, end - win):end]
        mel = log_mel(chunk, sm.num_mel_bins)
        out.append(_clip_window(mel, 0, mel.shape[1]))
        if end == len(audio):
            break
    return out


def decode_passes(sm, kvs: list, speculate: bool) -> tuple[float, list[tuple[int, ...]], int]:
    """Decode the passes one after another (spec on: each drafted from the previous pass's tokens). Returns
    (decode wall seconds, tokens per pass, target steps)."""
    engine = sm.new_engine("ngram+temporal" if speculate else "none", num_slots=1)
    prev: tuple[int, ...] | None = None
    toks, steps, wall = [], 0, 0.0
    for kv in kvs:
        hyp = None if (not speculate or prev is None) else [prev + (sm.tokens.eot,)]
        t0 = time.perf_counter()
        res = sm.decode(engine, [kv], hypotheses=hyp, speculate=speculate, language="en", timestamps=True,
                        logprobs=True)[0]
        wall += time.perf_counter() - t0
        toks.append(res.tokens)
        steps += res.target_steps
        prev = res.tokens
    return wall, toks, steps


def _faster_whisper(sm, compute_type: str, threads: int):
    src = sm.checkpoint.path / "CONVERTED_FROM"
    if not src.exists():
        return None
    from faster_whisper import WhisperModel

    return WhisperModel(src.read_text().split("\n")[0], device="cpu", compute_type=compute_type, cpu_threads=threads)


def bench_transcribe_main(argv: list[str]) -> int:
    from specstream.helptext import doc_help

    parser = argparse.ArgumentParser(prog="specstream bench transcribe", description=doc_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,whisper-base", help="comma list (tiny.en, whisper-base, dirs)")
    parser.add_argument("--recordings", default="espeak,bulletin", help="comma list: espeak, bulletin")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch and CTranslate2 threads (default 1)")
    parser.add_argument("--dtypes", default="float32", help="our weight precisions, comma list (float32, bfloat16)")
    parser.add_argument("--hop-s", type=float, default=1.0, help="audio between live passes (s)")
    parser.add_argument("--pass-window-s", type=float, default=10.0, help="audio per live pass (s)")
    parser.add_argument("--no-passes", action="store_true", help="skip the live-pass part")
    parser.add_argument("--no-faster-whisper", action="store_true",
                        help="skip the faster-whisper configurations (ours only)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny.en, 3 sentences, one round, no passes")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench_transcribe.json and .md")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    tests_dir_on_path()
    from live_fixtures import SCRIPT, compose, long_recording, wer

    from specstream.stages.speech import SpeechModel, transcribe

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="bench-transcribe-"))
    recs = {}
    names = ["espeak"] if args.quick else [x for x in args.recordings.split(",") if x]
    for name in names:
        if name == "espeak":
            sents = SCRIPT[:3] if args.quick else SCRIPT
            recs[name] = compose(tmp, sents, [0.5] * len(sents))
        elif name == "bulletin":
            recs[name] = long_recording(tmp)
        else:
            parser.error(f"unknown recording {name!r}")
    models = ["tiny.en"] if args.quick else [x for x in args.models.split(",") if x]
    rounds = 1 if args.quick else max(1, args.rounds)
    dtypes = [x for x in args.dtypes.split(",") if x]
    info = machine_info(args.threads)
    cpu, bandwidth = info["cpu"], info["read_bandwidth"]
    log(f"CPU: {cpu} ({os.cpu_count()} CPUs); read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); "
        f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    out: dict = {"date": datetime.date.today().isoformat(), "cpu": cpu, "read_bandwidth": bandwidth,
                 "threads": args.threads,
                 "loadavg_start": round(os.getloadavg()[0], 2), "rounds": rounds,
                 "options": {"beam_size": 1, "temperature": 0.0, "condition_on_previous_text": False,
                             "vad_filter": True, "language": "en", "timestamps": True},
                 "recordings": {k: round(r.duration_s, 2) for k, r in recs.items()}, "models": {}}
    for model_name in models:
        configs: dict = {}
        loaded: dict = {}  # " int4" (the configurations' suffix) -> its model: each precision is profiled too
        for dt in dtypes:
            sm = SpeechModel.load(model_name, dtype=dt)
            suffix = "" if dt == "float32" else f" {dt}"
            loaded[suffix] = sm
            for spec in (False, True):
                configs[f"ours spec {'on' if spec else 'off'}{suffix}"] = functools.partial(
                    lambda audio, sm=sm, spec=spec: transcribe(audio, sm, language="en", speculate=spec,
                                                               drafter="ngram" if spec else "none").text)
        sm = loaded.get("") or SpeechModel.load(model_name)  # float32: the passes
        if not args.no_faster_whisper:
            for ct in ("float32", "int8"):
                fw = _faster_whisper(sm, ct, args.threads)
                if fw is not None:
                    configs[f"faster-whisper {ct}"] = functools.partial(
                        lambda audio, fw=fw: " ".join(s.text for s in fw.transcribe(
                            audio, beam_size=1, temperature=0.0, condition_on_previous_text=False, vad_filter=True,
                            language="en")[0]))
        m: dict = {"transcribe": {}, "passes": {}, "profile": {}}
        out["models"][model_name] = m
        for rname, rec in recs.items():
            dur = len(rec.audio) / 16000
            texts = {name: fn(rec.audio) for name, fn in configs.items()}  # warm-up, and the text for WER
            walls: dict[str, list[float]] = {name: [] for name in configs}
            order = list(configs)
            for r in range(rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    t0 = time.perf_counter()
                    configs[name](rec.audio)
                    walls[name].append(time.perf_counter() - t0)
            rows = {}
            for name in configs:
                rtf = [w / dur for w in walls[name]]
                rows[name] = {"wer": round(wer(rec.text, texts[name]), 3), "rtf_median": round(statistics.median(rtf), 4),
                              "rtf_runs": [round(x, 4) for x in rtf]}
            off = walls["ours spec off"]
            for name, row in rows.items():  # ratios of the same rounds: how many times faster than ours-off / fw int8
                row["x_vs_ours_off"] = round(paired_ratio(off, walls[name]), 3)
                if "faster-whisper int8" in walls:
                    row["x_vs_fw_int8"] = round(paired_ratio(walls["faster-whisper int8"], walls[name]), 3)
            m["transcribe"][rname] = rows
            for name, row in rows.items():
                log(f"{model_name} {rname} ({dur:.1f} s) {name}: WER {row['wer']}, RTF {row['rtf_median']}, "
                    f"x{row['x_vs_ours_off']} vs ours off, x{row.get('x_vs_fw_int8')} vs fw int8")
            m["profile"][rname] = {f"spec {'on' if s else 'off'}{suffix}": profile_transcribe(smx, rec.audio, s)
                                   for suffix, smx in loaded.items() for s in (False, True)}
            log(f"  profile: {m['profile'][rname]}")
            if not (args.no_passes or args.quick):
                windows = live_passes(sm, rec.audio, args.hop_s, args.pass_window_s)
                kvs = [sm.project(sm.encode(w))[0] for w, _ in windows]
                decode_passes(sm, kvs[:2], True)  # warm
                res = {True: [], False: []}
                for r in range(rounds):
                    for spec in ((False, True) if r % 2 == 0 else (True, False)):
                        res[spec].append(decode_passes(sm, kvs, spec))
                off_w, on_w = [x[0] for x in res[False]], [x[0] for x in res[True]]
                m["passes"][rname] = {
                    "passes": len(kvs), "hop_s": args.hop_s, "window_s": args.pass_window_s,
                    "decode_s_off": round(statistics.median(off_w), 3), "decode_s_on": round(statistics.median(on_w), 3),
                    "x_on_vs_off": round(paired_ratio(off_w, on_w), 3),
                    "steps_off": res[False][0][2], "steps_on": res[True][0][2],
                    "identical_tokens": all(x[1] == res[False][0][1] for x in res[True] + res[False])}
                log(f"  passes: {m['passes'][rname]}")
        _write(out, args.out)  # after every model, so a long run that is stopped keeps what it measured
    _write(out, args.out)
    print(json.dumps(out, indent=1))
    return 0


def _write(out: dict, directory: Path | None) -> None:
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    if directory is not None:
        write_results(directory, "bench_transcribe", out, markdown=markdown(out), indent=1)


def markdown(out: dict) -> str:
    """The run as markdown tables (docs/benchmarks.md quotes them)."""
    bandwidth = (f"read bandwidth {out['read_bandwidth'] / 1e9:.1f} GB/s" if out.get("read_bandwidth")
                 else "read bandwidth not recorded")
    lines = [f"# bench transcribe ({out['date']})", "",
             f"CPU: {out['cpu']}; {bandwidth}; {out['threads']} thread(s) for torch and CTranslate2; load average "
             f"{out['loadavg_start']} at start, {out['loadavg_end']} at end; median of {out['rounds']} alternating "
             f"rounds. Options: beam 1, temperature 0, timestamps, VAD, no previous text, English.", "",
             *md_table(["model", "recording", "configuration", "WER", "RTF", "x vs ours off",
                        "x vs faster-whisper int8"],
                       [[model, f"{rname} ({out['recordings'][rname]} s)", name, row["wer"], row["rtf_median"],
                         row["x_vs_ours_off"], row.get("x_vs_fw_int8", "")]
                        for model, m in out["models"].items() for rname, rows in m["transcribe"].items()
                        for name, row in rows.items()])]
    lines += ["", "Live passes (decode only; spec on drafts each pass from the previous pass):", "",
              *md_table(["model", "recording", "passes", "decode s off", "decode s on", "x on vs off",
                         "steps off / on", "same tokens"],
                        [[model, rname, p["passes"], p["decode_s_off"], p["decode_s_on"], p["x_on_vs_off"],
                          f"{p['steps_off']} / {p['steps_on']}", p["identical_tokens"]]
                         for model, m in out["models"].items() for rname, p in m["passes"].items()])]
    lines += ["", "Per-step profile of one transcription per configuration:", "",
              *md_table(["model", "recording", "speculation", "wall s", "encoder s", "decoder forwards s",
                         "decode host ms/step", "forward ms/step", "target steps", "tokens"],
                        [[model, rname, name, p["wall_s"], p["encoder_s"], p["decoder_forward_s"],
                          p["decode_host_ms_per_step"], p["forward_ms_per_step"], p["target_steps"], p["tokens"]]
                         for model, m in out["models"].items() for rname, prof in m["profile"].items()
                         for name, p in prof.items()])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(bench_transcribe_main(sys.argv[1:]))
