"""A/B of ``transcribe``'s decode step and VAD against an earlier commit's, in one process, beside faster-whisper.

``python scripts/transcribe_step_ab.py [--base dc341f2] [--models tiny.en,whisper-base] [--rounds 5]``

The earlier commit's ``stages/speculative/executor.py`` is loaded from git as a module of its own; "old" swaps its
``_forward_and_verify`` and ``_verify_and_commit`` into the executor and runs Silero VAD frame by frame (as before
the sequence model); "new" is this checkout. Both decode with int4 weights, speculation off, one torch thread,
faster-whisper int8 (beam 1, its VAD, one thread) in the same rounds, the order rotated per round. Prints the CPU
and its read bandwidth, then per model and recording: each configuration's median real-time factor and WER, and
the medians of the per-round ratios (new vs old, new vs faster-whisper int8). Needs the Whisper weights
(``specstream models fetch``) and faster-whisper. Only for reading: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="dc341f2", help="the commit whose executor is 'old'")
    parser.add_argument("--models", default="tiny.en,whisper-base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    from faster_whisper import WhisperModel
    from live_fixtures import SCRIPT, compose, long_recording, wer

    from specstream.pipeline.bench.harness import machine_info
    from specstream.stages import vad
    from specstream.stages.speculative import executor
    from specstream.stages.speech import SpeechModel, transcribe

    src = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{args.base}:stages/speculative/executor.py"],
                                  text=True)
    old = types.ModuleType("old_executor")
    sys.modules["old_executor"] = old  # dataclasses look their module up
    exec(compile(src, "old_executor.py", "exec"), old.__dict__)
    cls = executor.SpeculativeExecutor
    new = (cls._forward_and_verify, cls._verify_and_commit, vad._sequence_session)

    def mode(name: str) -> None:
        if name == "old":
            cls._forward_and_verify = old.SpeculativeExecutor._forward_and_verify
            cls._verify_and_commit = old.SpeculativeExecutor._verify_and_commit
            vad._sequence_session = lambda: None
        else:
            cls._forward_and_verify, cls._verify_and_commit, vad._sequence_session = new

    tmp = Path(tempfile.mkdtemp(prefix="transcribe-ab-"))
    recs = {"espeak": compose(tmp, SCRIPT, [0.5] * len(SCRIPT)), "bulletin": long_recording(tmp)}
    info = machine_info(1)
    print(f"CPU {info['cpu']}; read bandwidth {info['read_bandwidth'] / 1e9:.1f} GB/s (1 thread); load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    results: dict = {"cpu": info["cpu"], "read_bandwidth": info["read_bandwidth"], "base": args.base, "rows": {}}
    for model in args.models.split(","):
        sm = SpeechModel.load(model, dtype="int4")
        fw = WhisperModel((sm.checkpoint.path / "CONVERTED_FROM").read_text().split("\n")[0], device="cpu",
                          compute_type="int8", cpu_threads=1)
        for rname, rec in recs.items():
            def ours(name: str, rec=rec) -> str:
                mode(name)
                return transcribe(rec.audio, sm, language="en", speculate=False, drafter="none").text

            def faster(rec=rec) -> str:
                segs, _ = fw.transcribe(rec.audio, beam_size=1, temperature=0.0, condition_on_previous_text=False,
                                        vad_filter=True, language="en")
                return " ".join(s.text for s in segs)

            cfgs = {"old": lambda: ours("old"), "new": lambda: ours("new"), "faster-whisper int8": faster}
            texts = {k: f() for k, f in cfgs.items()}  # warm-up, and the texts for WER
            walls: dict[str, list[float]] = {k: [] for k in cfgs}
            names = list(cfgs)
            for r in range(args.rounds):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.perf_counter()
                    cfgs[k]()
                    walls[k].append(time.perf_counter() - t0)
            mode("new")

            def ratio(faster_of: str, than: str) -> float:
                return round(statistics.median(b / a for a, b in zip(walls[faster_of], walls[than])), 3)

            row = {k: {"rtf": round(statistics.median(v) / rec.duration_s, 4), "wer": round(wer(rec.text, texts[k]), 3)}
                   for k, v in walls.items()}
            row.update({"new vs old": ratio("new", "old"),
                        "new vs faster-whisper int8": ratio("new", "faster-whisper int8"),
                        "old vs faster-whisper int8": ratio("old", "faster-whisper int8")})
            results["rows"][f"{model} {rname}"] = row
            print(model, rname, json.dumps(row), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
