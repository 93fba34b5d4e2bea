"""Which of our files one request runs through, from its entry to the first device step (and, for the WebSocket,
back to its final).

Usage::

    python scripts/request_path.py caption clip.mp4        # the CLI: specstream caption clip.mp4
    python scripts/request_path.py qa clip.mp4 "question"  # the CLI: specstream qa (one question)
    python scripts/request_path.py chat image.png          # POST /v1/chat/completions with the image
    python scripts/request_path.py ws-final speech.wav     # WebSocket /v1/subtitles: audio chunks -> a final

``-v`` also names the functions entered in each file.

A profile hook on every thread records each of our source files one of whose functions (not its import) ran
while the request was being handled, in the order first entered, and marks those of the shared step core
(``core``). For the two CLI commands the walk starts at ``main`` (model construction included: a CLI process
builds its models for its request). For the two server routes the app is started and warmed by one identical
request first, so the walk is the request's own: it starts when the request is sent. The walk before the first
``DeviceLoop.step`` is printed for all four; for ``ws-final`` the files entered after that step until the client
holds its first ``final`` (the way back) are printed too. Child processes (the video decoder,
``modalities/_video_worker.py``) are not traced. docs/architecture.md ("Request paths") quotes its output.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import tempfile
import threading

ROOTS = ("specstream", "pipeline", "stages", "schedulers", "modalities", "kernels")
CORE = ("schedulers/qos.py", "stages/speculative/executor.py", "stages/speculative/tree.py",
        "stages/speculative/models/llama.py", "stages/speculative/models/kv_cache.py", "kernels/verification.py",
        "kernels/sampling.py")


class Walk:
    """Files entered while :attr:`armed`, split at the first ``DeviceLoop.step`` after arming."""

    def __init__(self, repo: str):
        self.repo = repo
        self.armed = threading.Event()
        self.stepped = threading.Event()
        self.before: dict[str, dict[str, None]] = {}
        self.after: dict[str, dict[str, None]] = {}

    def hook(self, frame, event, arg):
        if not self.armed.is_set() or event != "call" or frame.f_code.co_name == "<module>":
            return  # module bodies (imports) do not count: only files whose functions run
        if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return  # nor class bodies (they run at import; functions and comprehensions are CO_OPTIMIZED)
        path = frame.f_code.co_filename
        if not path.startswith(self.repo + os.sep):
            return
        rel = os.path.relpath(path, self.repo)
        if rel.split(os.sep)[0] not in ROOTS:
            return
        if rel == os.path.join("stages", "device_loop.py") and frame.f_code.co_name == "step":
            self.stepped.set()
        (self.after if self.stepped.is_set() else self.before).setdefault(rel, {}).setdefault(
            frame.f_code.co_name, None)

    @contextlib.contextmanager
    def installed(self):
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def _print(title: str, files: dict[str, dict[str, None]], verbose: bool) -> None:
    print(title)
    for n, (rel, funcs) in enumerate(files.items(), 1):
        names = f"  ({', '.join(list(funcs)[:8])}{', ...' if len(funcs) > 8 else ''})" if verbose else ""
        print(f"{n:3d} {rel}{'  core' if rel in CORE else ''}{names}")
    print(f"{len(files)} files, {sum(f not in CORE for f in files)} outside the step core")


def _cli(walk: Walk, argv: list[str]) -> int:
    from specstream.cli import main as cli

    walk.armed.set()
    return cli(argv)


def run_caption(walk: Walk, args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        return _cli(walk, ["caption", *args, "--out", os.path.join(tmp, "out.jsonl"), "--max-new-tokens", "2",
                           "--no-progress"])


def run_qa(walk: Walk, args: list[str]) -> int:
    video, question = args[0], " ".join(args[1:]) or "What happens?"
    with tempfile.TemporaryDirectory() as tmp:
        qs = os.path.join(tmp, "questions.jsonl")
        with open(qs, "w") as f:
            f.write(json.dumps({"id": "v1", "video": os.path.abspath(video),
                                "questions": [{"id": "q1", "text": question}]}) + "\n")
        return _cli(walk, ["qa", qs, "--out", os.path.join(tmp, "answers.jsonl"), "--max-new-tokens", "2",
                           "--no-progress"])


class _Server:
    """``specstream serve``'s app under uvicorn on a loopback port, in a thread (started inside the hook, so its
    threads are traced), ready when ``/readyz`` says every model has loaded (Whisper loads in the background)."""

    def __init__(self, timeout_s: float = 600.0):
        import socket
        import time

        import httpx
        import uvicorn

        from specstream.pipeline.server import ServerSettings, create_app, uvicorn_options

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        settings = ServerSettings(port=port)
        self.base = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(settings), **uvicorn_options(settings),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")
            time.sleep(0.3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def run_chat(walk: Walk, args: list[str]) -> int:
    import base64

    import httpx

    image = args[0]
    ext = os.path.splitext(image)[1].lstrip(".").lower().replace("jpg", "jpeg") or "png"
    url = f"data:image/{ext};base64," + base64.b64encode(open(image, "rb").read()).decode()
    body = {"model": "specstream-tiny-llava", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in the image?"}]}]}
    with _Server() as srv:
        warm = httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=300)
        if warm.status_code != 200:
            print(warm.text, file=sys.stderr)
            return 1
        walk.armed.set()
        r = httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=300)
        walk.armed.clear()
    return 0 if r.status_code == 200 else 1


def run_ws_final(walk: Walk, args: list[str]) -> int:
    import wave

    from websockets.sync.client import connect

    with wave.open(args[0]) as w:  # mono 16-bit PCM (espeak-ng -w writes it)
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise SystemExit(f"{args[0]}: expected a mono 16-bit PCM WAV")
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    chunk = 2 * (rate // 5)  # 200-ms frames, in bytes

    def one_session(url: str) -> bool:
        with connect(url) as ws:
            ws.send(json.dumps({"type": "start", "sample_rate": rate, "format": "pcm_s16le"}))
            for i in range(0, len(pcm), chunk):
                ws.send(pcm[i:i + chunk])
            ws.send(json.dumps({"type": "stop"}))
            got = False
            while True:  # read to "done": the session then closes cleanly
                msg = json.loads(ws.recv(timeout=300))
                if msg["type"] == "final" and not got:
                    walk.armed.clear()
                    got = True
                if msg["type"] == "done":
                    return got

    with _Server() as srv:
        url = srv.base.replace("http", "ws") + "/v1/subtitles"
        if not one_session(url):
            print("the warm-up session gave no final (is the recording speech?)", file=sys.stderr)
            return 1
        walk.armed.set()
        return 0 if one_session(url) else 1


RUNS = {"caption": run_caption, "qa": run_qa, "chat": run_chat, "ws-final": run_ws_final}


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    argv = [a for a in argv if a != "-v"]
    if len(argv) < 2 or argv[0] not in RUNS:
        print(__doc__, file=sys.stderr)
        return 2
    import specstream

    repo = os.path.dirname(os.path.dirname(os.path.abspath(specstream.__file__)))
    walk = Walk(repo)
    with walk.installed():
        code = RUNS[argv[0]](walk, argv[1:])
    _print(f"{argv[0]}: before the first device step", walk.before, verbose)
    if argv[0] == "ws-final":
        _print("ws-final: after the first device step, until the client holds a final",
               {f: fn for f, fn in walk.after.items() if f not in walk.before}, verbose)
    print(f"(exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
