"""Which of our files one request runs through, from its entry to the first device step (and, for the WebSocket,
back to its final): two measures.

Usage::

    python scripts/request_path.py caption clip.mp4        # the CLI: specstream caption clip.mp4
    python scripts/request_path.py qa clip.mp4 "question"  # the CLI: specstream qa (one question)
    python scripts/request_path.py chat image.png          # POST /v1/chat/completions with the image
    python scripts/request_path.py ws-final speech.wav     # WebSocket /v1/subtitles: audio chunks -> a final

``-v`` also names the functions of each file.

**The submit chain** (the request's path proper, the measure docs/architecture.md holds to 6 files): the files of
ours on the call stack of the frame that hands the request to the device loop (the first call, after the walk
starts, of ``DeviceLoop.submit`` / ``submit_group`` / ``submit_threadsafe`` / ``add_request`` from outside
``stages/device_loop.py``), from the entry down to that frame, each file once, in the order first met. An async
caller's await chain is on that stack (a running coroutine's frames nest). Where the chain crosses a hand-over of
work, the stack of the code that handed it over is put in front, recursively: an asyncio task (created through
``BaseEventLoop.create_task``, which ``asyncio.create_task``, ``asyncio.run`` and anyio's task groups call), a
thread (``Thread.start``) and a thread-pool work item (``ThreadPoolExecutor.submit``: ``asyncio.to_thread``,
``run_in_executor``); for uvloop, whose ``create_task`` is compiled, a task factory set on every running loop.
So a file cannot leave the chain by spawning a task. A helper that was called and returned
before the hand-off (opening the input, selecting keyframes, preparing the image) is not on the chain: the chain
is what a reader follows from the entry to the hand-off, the helpers are one call each off it.

**All files entered** (honest about the rest of the work, not held to 6): a profile hook on every thread records
each of our source files one of whose functions (not its import; not a class body) ran while the request was
being handled, in the order first entered, until the first ``DeviceLoop.step`` after the walk starts.

Both mark the shared step core (``core``: qos, executor, tree, the decoder, kv_cache, verification, sampling),
which neither counts. For the two CLI commands the walk starts at ``main`` (model construction included: a CLI
process builds its models for its request). For the two server routes the app is started and warmed by one
identical request first, so the walk is the request's own: it starts when the request is sent. For ``ws-final``
the files entered after the first step until the client holds its first ``final`` (the way back) are printed
too. Child processes (the video decoder, ``modalities/_video_worker.py``) are not traced. docs/architecture.md
("Request paths") quotes the output.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import concurrent.futures.thread
import contextlib
import inspect
import json
import os
import sys
import tempfile
import threading
import weakref

ROOTS = ("specstream", "pipeline", "stages", "schedulers", "modalities", "kernels")
CORE = ("schedulers/qos.py", "stages/speculative/executor.py", "stages/speculative/tree.py",
        "stages/speculative/models/llama.py", "stages/speculative/models/kv_cache.py", "kernels/verification.py",
        "kernels/sampling.py")


HANDOFF = ("DeviceLoop.submit", "DeviceLoop.submit_group", "DeviceLoop.submit_threadsafe", "DeviceLoop.add_request")
DEVICE_LOOP = "stages/device_loop.py"

Chain = list[tuple[str, str]]  # (file relative to the repo, function's qualified name), outermost first


def ours(path: str, repo: str) -> str | None:
    """``path`` relative to ``repo`` (``/``-separated) if it is one of our source files (under :data:`ROOTS`),
    else None."""
    if not path.startswith(repo + os.sep):
        return None
    rel = os.path.relpath(path, repo).replace(os.sep, "/")
    return rel if rel.split("/")[0] in ROOTS else None


def stack_chain(frame, repo: str) -> Chain:
    """The frames of ours on ``frame``'s call stack (``frame`` included), outermost first, as (file, function).
    A running coroutine's awaiting coroutines are on it (``f_back``); what spawned the task is not (see
    :class:`Walk`)."""
    out: Chain = []
    while frame is not None:
        rel = ours(frame.f_code.co_filename, repo)
        if rel is not None:  # a nested function by its own name: make_app.<locals>.route -> route
            out.append((rel, frame.f_code.co_qualname.rpartition("<locals>.")[2]))
        frame = frame.f_back
    out.reverse()
    return out


def chain_files(chain: Chain) -> dict[str, list[str]]:
    """Each file of ``chain`` once, in the order first met -> its functions on the chain, in order."""
    files: dict[str, list[str]] = {}
    for rel, func in chain:
        funcs = files.setdefault(rel, [])
        if func not in funcs:
            funcs.append(func)
    return files


class Walk:
    """Files entered while :attr:`armed`, split at the first ``DeviceLoop.step`` after arming; and the submit
    chain of the first hand-off to the device loop after arming (:attr:`submit_chain`).

    Hand-overs of work are followed at all times (armed or not, since a server's tasks and threads start before
    the request): the chain that led to an asyncio task's creation, a thread's start or a thread-pool work item's
    submission is kept for it (:attr:`links`), and the chain of code running in it starts with that.
    """

    _CREATE_TASK = asyncio.base_events.BaseEventLoop.create_task.__code__
    _WORK_ITEM = concurrent.futures.thread._WorkItem.__init__.__code__  # in the submitting thread, before queueing
    _WORK_RUN = concurrent.futures.thread._WorkItem.run.__code__
    _THREAD_START = threading.Thread.start.__code__

    def __init__(self, repo: str):
        self.repo = repo
        self.armed = threading.Event()
        self.stepped = threading.Event()
        self.before: dict[str, dict[str, None]] = {}
        self.after: dict[str, dict[str, None]] = {}
        self.links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # task/thread/future -> Chain
        self.working: dict[int, Chain] = {}  # thread id -> the chain of the pool work item it runs now
        self.loops: weakref.WeakSet = weakref.WeakSet()  # running event loops given our task factory
        self.handoffs: list[Chain] = []  # the chain of every hand-off while armed, in order

    @property
    def submit_chain(self) -> Chain | None:
        """The chain of the first hand-off to the device loop after arming (the request's path proper)."""
        return self.handoffs[0] if self.handoffs else None

    def origin(self) -> Chain:
        """The chain that handed the current thread the code it runs: its asyncio task's, else its thread-pool
        work item's, else its thread's (empty for threads nothing of ours started)."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running event loop in this thread
            task = None
        if task is not None and task in self.links:
            return self.links[task]
        work = self.working.get(threading.get_ident())
        if work is not None:
            return work
        return self.links.get(threading.current_thread(), [])

    def chain(self, frame) -> Chain:
        """The whole chain to ``frame``: :meth:`origin` then ``frame``'s stack."""
        return self.origin() + stack_chain(frame, self.repo)

    def _task_factory(self, loop, coro, context=None):
        """Every event loop's task factory (uvloop's ``create_task`` is compiled: no Python frame to see): the
        task's link is the chain of the code creating it."""
        task = asyncio.Task(coro, loop=loop, context=context)
        self.links[task] = self.chain(sys._getframe(1))
        return task

    def _follow(self, frame, event, arg) -> None:
        loop = asyncio._get_running_loop()
        if loop is not None and loop not in self.loops:
            if loop.get_task_factory() is not None:
                raise RuntimeError("request_path: the event loop already has a task factory")
            loop.set_task_factory(self._task_factory)
            self.loops.add(loop)
        code = frame.f_code
        if event == "return":
            if code is self._CREATE_TASK and arg is not None:  # plain asyncio, also before its loop runs
                self.links[arg] = self.chain(frame)
            elif code is self._WORK_RUN:
                self.working.pop(threading.get_ident(), None)
        elif event == "call":
            if code is self._THREAD_START:
                self.links[frame.f_locals["self"]] = self.chain(frame)
            elif code is self._WORK_ITEM:  # a pool worker may run the item before submit returns
                self.links[frame.f_locals["future"]] = self.chain(frame)
            elif code is self._WORK_RUN:
                self.working[threading.get_ident()] = self.links.get(frame.f_locals["self"].future, [])

    def hook(self, frame, event, arg):
        if event in ("call", "return"):
            self._follow(frame, event, arg)
        if not self.armed.is_set() or event != "call" or frame.f_code.co_name == "<module>":
            return  # module bodies (imports) do not count: only files whose functions run
        if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return  # nor class bodies (they run at import; functions and comprehensions are CO_OPTIMIZED)
        rel = ours(frame.f_code.co_filename, self.repo)
        if rel is None:
            return
        if rel == DEVICE_LOOP:
            if frame.f_code.co_name == "step":
                self.stepped.set()
            elif (frame.f_code.co_qualname in HANDOFF
                  and ours(frame.f_back.f_code.co_filename, self.repo) != DEVICE_LOOP):
                self.handoffs.append(self.chain(frame))
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
            for loop in list(self.loops):  # loops that outlive the walk create their tasks as before
                if loop.get_task_factory() == self._task_factory:
                    loop.set_task_factory(None)


def _print(title: str, files, verbose: bool) -> None:
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
    if walk.submit_chain is None:
        print(f"{argv[0]}: no hand-off to the device loop seen")
    else:
        _print(f"{argv[0]}: submit chain (entry -> the first hand-off to the device loop)",
               chain_files(walk.submit_chain), verbose)
        others: dict[tuple[str, ...], int] = {}
        for chain in walk.handoffs[1:]:
            files = tuple(chain_files(chain))
            if files != tuple(chain_files(walk.submit_chain)):
                others[files] = others.get(files, 0) + 1
        for files, n in others.items():  # e.g. qa: the transcription first, then the question's generation
            print(f"  later hand-off{'s' if n > 1 else ''} ({n}) by another chain: {' -> '.join(files)}  "
                  f"({sum(f not in CORE for f in files)} files outside the step core)")
    _print(f"{argv[0]}: all files entered before the first device step", walk.before, verbose)
    if argv[0] == "ws-final":
        _print("ws-final: after the first device step, until the client holds a final",
               {f: fn for f, fn in walk.after.items() if f not in walk.before}, verbose)
    print(f"(exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
