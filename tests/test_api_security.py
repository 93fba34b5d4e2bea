"""Security of the HTTP/WebSocket API (``specstream serve``): allowed roots against symlink swaps, upload file
names, upload sizes, credentials in logs, the WebSocket key handshake, and what error records reveal.

Two servers: an in-process app (FastAPI's TestClient) for the caption route, where a test must hold the caption
lock or hook the open, and a real ``specstream serve`` process on a loopback port for everything that needs real
sockets, real logging configuration and a browser. Neither loads a speech model (``SPECSTREAM_SPEECH_MODEL``
names a missing directory, so ``/readyz`` stays 503 and subtitle sessions are refused with 1013 after any key
check).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from binaries import CHROMIUM_ARGS
from media import sources

KEY = "s3cret-Key-42"
KEY_B64 = base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
LIMIT = 1 << 20  # max_upload_bytes of the served process
TOKENS = 3


def _png(array: np.ndarray, size: int = 48) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).resize((size, size)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pictures():
    """(inside PNG bytes, outside PNG bytes): astronaut and rocket, 48x48."""
    from PIL import Image

    src = sources()
    return _png(np.asarray(Image.open(src["astronaut"]).convert("RGB"))), \
        _png(np.asarray(Image.open(src["rocket"]).convert("RGB")))


# -- the in-process app ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(tmp_path_factory, pictures):
    """(TestClient, allowed root, outside dir) of an app whose allowed root holds ``a.png`` and ``sub/a.png`` (the
    astronaut) and whose outside dir holds ``a.png`` (the rocket)."""
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    base = tmp_path_factory.mktemp("roots")
    root, outside = base / "root", base / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    inside_png, outside_png = pictures
    for p in (root / "a.png", root / "sub" / "a.png"):
        p.write_bytes(inside_png)
    (outside / "a.png").write_bytes(outside_png)
    settings = ServerSettings(allowed_roots=[root], speech_model=str(base / "no-speech-model"),
                              caption_concurrency=1)  # one caption at a time: the tests wait behind it
    with TestClient(create_app(settings)) as client:
        yield client, root, outside


def _caption_uri(client, uri: str) -> list[dict]:
    r = client.post("/v1/captions", data={"source_uri": uri, "max_new_tokens": str(TOKENS)})
    assert r.status_code == 200, r.text
    return r.json()["records"]


def _upload(client, name: str, data: bytes) -> dict:
    """POST ``data`` as the multipart file part with the exact ``filename`` header value ``name``."""
    boundary = "specstream-test-boundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode("utf-8")
    tail = (f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="max_new_tokens"\r\n\r\n{TOKENS}\r\n'
            f"--{boundary}--\r\n").encode()
    r = client.post("/v1/captions", content=head + data + tail,
                    headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 200, (name, r.status_code, r.text)
    (record,) = r.json()["records"]
    return record


@pytest.fixture(scope="module")
def reference_tokens(api, pictures):
    """Tokens of the inside and of the outside picture, each uploaded under a plain name."""
    client, _, _ = api
    inside, outside = (_upload(client, "ref.png", png) for png in pictures)
    assert inside["tokens"] != outside["tokens"]  # the two pictures are told apart by their captions
    return inside["tokens"], outside["tokens"]


def _swap_file(root: Path, outside: Path) -> None:
    """``root/a.png`` becomes a symlink to ``outside/a.png``."""
    os.replace(root / "a.png", root / "a.png.orig")
    (root / "a.png").symlink_to(outside / "a.png")


def _swap_dir(root: Path, outside: Path) -> None:
    """``root/sub`` becomes a symlink to ``outside`` (which holds its own ``a.png``)."""
    os.replace(root / "sub", root / "sub.orig")
    (root / "sub").symlink_to(outside, target_is_directory=True)


def _restore(root: Path) -> None:
    for name in ("a.png", "sub"):
        if (root / f"{name}.orig").exists():
            (root / name).unlink()
            os.replace(root / f"{name}.orig", root / name)


@pytest.mark.parametrize("swap", ["file", "parent_dir"])
def test_source_swapped_while_waiting_for_the_caption_lock_is_not_captioned(api, reference_tokens, swap):
    """The request's check passes; while it waits for the caption lock the file (or its directory) becomes a
    symlink out of the allowed roots. The graph opens the source once, re-checking then: an error record, never
    the outside file's caption."""
    client, root, outside = api
    state = client.app.state.specstream
    uri = str(root / "a.png") if swap == "file" else str(root / "sub" / "a.png")
    lock = state._caption_lock
    client.portal.call(lock.acquire)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_caption_uri, client, uri)
            t0 = time.monotonic()
            while state.caption_waiting < 1:  # the request passed its check and waits for the lock
                assert time.monotonic() - t0 < 60 and not pending.done(), "the request never queued"
                time.sleep(0.01)
            (_swap_file if swap == "file" else _swap_dir)(root, outside)
            client.portal.call(lock.release)
            (record,) = pending.result(timeout=120)
    finally:
        if lock.locked():
            client.portal.call(lock.release)
        _restore(root)
    assert "tokens" not in record, record  # the old code captioned the outside picture here
    assert record == {"source": uri, "error": {"code": "unreadable_source",
                                               "message": f"{uri}: outside the allowed roots"}}


@pytest.mark.parametrize("swap", ["file", "parent_dir", "other_file"])
def test_swap_between_the_roots_check_and_the_open_is_refused(api, reference_tokens, monkeypatch, swap):
    """The narrowest window: the swap happens after the graph's own roots check and before its open (the test
    seam ``_between_check_and_open``). The per-component O_NOFOLLOW walk refuses a symlinked file or directory,
    the (st_dev, st_ino) check a different file renamed into place: ``source_changed``."""
    from specstream.modalities import source

    client, root, outside = api
    uri = str(root / ("sub/a.png" if swap == "parent_dir" else "a.png"))
    calls = []

    def hook(real: str) -> None:
        calls.append(real)
        if swap == "file":
            _swap_file(root, outside)
        elif swap == "parent_dir":
            _swap_dir(root, outside)
        else:  # a regular file inside the root, but not the one checked
            os.replace(root / "a.png", root / "a.png.orig")
            shutil.copy(root / "a.png.orig", root / "a.png")

    monkeypatch.setattr(source, "_between_check_and_open", hook)
    try:
        (record,) = _caption_uri(client, uri)
    finally:
        _restore(root)
    assert calls == [uri]
    assert record["source"] == uri and "tokens" not in record
    assert record["error"]["code"] == "source_changed", record
    where = "one of its directories" if swap == "parent_dir" else ("the file" if swap == "file" else "another file")
    assert record["error"]["message"].startswith(f"{uri}: {where}"), record


def test_inside_file_and_inside_symlink_still_work(api, reference_tokens, tmp_path):
    """The checks refuse nothing legitimate: a file in the root, a symlink in the root to a file in the root, each
    captioned exactly as an upload of the same picture."""
    client, root, _ = api
    link = root / "link.png"
    link.symlink_to(root / "sub" / "a.png")
    try:
        for uri in (str(root / "a.png"), str(root / "sub" / "a.png"), str(link)):
            (record,) = _caption_uri(client, uri)
            assert (record["source"], record["kind"], record["tokens"]) == (uri, "image", reference_tokens[0])
    finally:
        link.unlink()


def test_opened_source_is_read_by_descriptor_never_by_path(tmp_path):
    """After `open_source`, the path may name anything: the image loader and both decoding child processes (proxy
    frames and full-resolution decode) read the file that was opened (descriptors passed to the children)."""
    from specstream.modalities.image import load_image
    from specstream.modalities.source import open_source
    from specstream.modalities.video import VideoDecodeSession, decode_frames

    src = sources()
    shutil.copy(src["bikes"], tmp_path / "v.mp4")
    shutil.copy(src["astronaut"], tmp_path / "p.png")
    with open_source(tmp_path / "v.mp4", [tmp_path]) as video, open_source(tmp_path / "p.png", [tmp_path]) as image:
        for name, other in (("v.mp4", src["bigbuckbunny"]), ("p.png", src["rocket"])):
            (tmp_path / name).unlink()
            (tmp_path / name).symlink_to(other)  # the path now names another (readable) file
        assert load_image(image.path).shape == (512, 512, 3)  # astronaut, not the 427x640 rocket
        with VideoDecodeSession(video.path, backend="pyav") as s:
            frames = sum(1 for _ in s.proxy_frames())
            full = s.decode_full([0.0])
        assert (frames, s.info.width, s.info.height) == (250, 640, 272)  # bikes; bigbuckbunny: 132 at 1280x720
        assert full[0].shape == decode_frames(video.path, [0.0])[0].shape == (272, 640, 3)


def test_open_source_errors(tmp_path):
    from specstream.errors import UnreadableSourceError
    from specstream.modalities.source import open_source

    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(b"secret")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(root / "fifo.mp4")
    cases = {
        str(root / "escape.png"): f"{root / 'escape.png'}: outside the allowed roots",
        str(root / ".." / "secret.png"): f"{root / '..' / 'secret.png'}: outside the allowed roots",
        str(root / "missing.png"): f"no such file: {root / 'missing.png'}",
        str(root): f"is a directory, not a media file: {root}",
        str(root / "fifo.mp4"): f"not a regular file: {root / 'fifo.mp4'}",  # opening it does not wait
        str(root / "fifo.mp4" / "x.png"): f"cannot open {root / 'fifo.mp4' / 'x.png'}: Not a directory",
    }
    for path, message in cases.items():
        with pytest.raises(UnreadableSourceError) as exc:
            open_source(path, [root])
        assert (exc.value.code, exc.value.message) == ("unreadable_source", message)
    (root / "big.png").write_bytes(b"x" * 101)
    with pytest.raises(UnreadableSourceError, match="101 bytes exceeds the limit of 100"):
        open_source(root / "big.png", [root], max_bytes=100)


# -- upload names and what error records show -------------------------------------------------------------------
@pytest.mark.parametrize("name, shown", [
    ("/", "upload"), (".", "upload"), ("..", "upload"), ("", "upload"),
    ("a" * 300 + ".png", "a" * 251 + ".png"),  # 255 bytes, extension kept
    ("\u00e9" * 200 + ".png", "\u00e9" * 125 + ".png"),  # 254 bytes: a 2-byte character is never cut in half
    ("../../etc/cron.d/x.png", "x.png"),
    ("C:\\Users\\me\\photo.png", "photo.png"),
    ("tab\there.png", "tabhere.png"),
])
def test_odd_upload_file_names(api, reference_tokens, pictures, name, shown):
    """Names that gave a 500 (``/``, ``.``, ``..``, over 255 bytes) and other odd ones: answered 200, the record
    shows the sanitised name. Names that keep a ``.png`` extension are captioned like any upload; the others carry
    no media extension and here no media either: an ``unsupported_media`` record."""
    client, _, _ = api
    if shown.endswith(".png"):
        record = _upload(client, name, pictures[0])
        assert (record["source"], record["kind"], record["tokens"]) == (shown, "image", reference_tokens[0])
        assert len(shown.encode()) <= 255
    else:
        record = _upload(client, name, b"plain text, not media")
        assert record["source"] == shown and record["error"]["code"] == "unsupported_media", record


def test_error_records_show_the_client_file_name(api, pictures):
    """An upload that fails reports the client's name, in ``source`` and in the message: never the server's
    temporary upload path, never the descriptor path the graph read it by (image in this process, video in the
    decoding child)."""
    client, _, _ = api
    image = _upload(client, "p.png", pictures[0][:120])  # a PNG cut short
    video = _upload(client, "clip.mp4", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 4096)  # an mp4 box, then garbage
    assert image["source"] == "p.png" and image["error"]["code"] == "corrupt_media", image
    assert video["source"] == "clip.mp4" and video["error"]["code"] == "corrupt_media", video
    for record, name in ((image, "p.png"), (video, "clip.mp4")):
        text = json.dumps(record)
        assert name in record["error"]["message"], record
        assert "specstream-upload" not in text and "/proc/self/fd" not in text and "/tmp" not in text, record


# -- a real `specstream serve` process ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``specstream serve`` in a child process: its port, temp dir, pid and log files."""

    def __init__(self, base: Path):
        self.port = _free_port()
        self.tmp = base / "tmp"
        self.tmp.mkdir()
        self.out, self.err = base / "stdout.log", base / "stderr.log"
        env = {**os.environ, "TMPDIR": str(self.tmp), "SPECSTREAM_MAX_UPLOAD_BYTES": str(LIMIT),
               "SPECSTREAM_SPEECH_MODEL": str(base / "no-speech-model"), "PYTHONUNBUFFERED": "1"}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specstream", "serve", "--port", str(self.port), "--api-key", KEY,
                 "--log-level", "trace"], stdout=out, stderr=err, env=env)
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, self.logs()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() - t0 < 120, "specstream serve did not start: " + self.logs()
                time.sleep(0.1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("served"))
    yield s
    s.stop()


def _read_response_head(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Bytes up to the end of a response's header block (or all that came before EOF / the timeout)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(4096)
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


def test_declared_oversize_is_refused_before_the_body_is_read(served):
    """``Content-Length: 2 GiB`` with 64 KiB sent: the whole 413 answer arrives while the client has sent 64 KiB of
    its 2 GiB (it never sends more), i.e. before it could finish sending."""
    boundary = "b0undary"
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall((f"POST /v1/captions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {2 ** 31}\r\n"
                      f"\r\n").encode())
        sock.sendall(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.png"\r\n\r\n'
                     .encode() + b"\x00" * (64 * 1024))
        head = _read_response_head(sock)
    assert head.startswith(b"HTTP/1.1 413 "), head


def _temp_usage(pid: int, tmp: Path) -> int:
    """Bytes the process holds in files under ``tmp``: named files plus open unlinked ones (a spooled upload is an
    unnamed temporary file, visible only through the process's descriptors)."""
    seen, total = set(), 0
    for d, _, files in os.walk(tmp):
        for f in files:
            try:
                st = os.stat(os.path.join(d, f))
            except OSError:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith(str(tmp)):
                continue
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def test_streamed_oversize_is_cut_off_at_the_limit_and_never_spooled_beyond_it(served):
    """A chunked upload (no declared length) of 6x the limit. First LIMIT + 16 KiB of file data, then a pause: the
    server spools them to its temp dir (past Starlette's 1-MiB spool threshold) and waits, which the sampler must
    see (so it does see spooled bytes). Then the rest: answered 413; the server never held more than the
    request-body limit in its temp dir (sampled every millisecond, unlinked spool files included), and nothing is
    left there afterwards."""
    body_limit = LIMIT + 64 * 1024  # max_upload_bytes + FORM_OVERHEAD_BYTES: the route's request-body limit
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _temp_usage(served.proc.pid, served.tmp))
            time.sleep(0.001)

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    boundary = "b0undary"
    first = LIMIT + 16 * 1024
    sock = socket.create_connection(("127.0.0.1", served.port))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        sock.sendall((f"POST /v1/captions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                      f"Transfer-Encoding: chunked\r\n\r\n").encode())
        sock.sendall(chunk(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.png"\r\n'
                           f"\r\n".encode()) + chunk(b"\x01" * first))
        t0 = time.monotonic()
        while peak[0] < first:  # the spool on disk, waiting for more
            assert time.monotonic() - t0 < 30, f"the sampler never saw the spooled {first} bytes: {peak[0]}"
            time.sleep(0.01)

        def send_rest():
            try:
                for _ in range(5 * LIMIT // (64 * 1024)):
                    sock.sendall(chunk(b"\x01" * (64 * 1024)))
                sock.sendall(chunk(f"\r\n--{boundary}--\r\n".encode()) + b"0\r\n\r\n")
            except OSError:  # the server answered and stopped reading
                pass

        sender = threading.Thread(target=send_rest, daemon=True)
        sender.start()
        head = _read_response_head(sock, timeout=60)
        time.sleep(0.2)  # the request ends after its response: its spool is closed then
    finally:
        stop.set()
        sampler.join(10)
        sock.close()
    sender.join(10)
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert first <= peak[0] <= body_limit, (peak[0], body_limit)
    assert _temp_usage(served.proc.pid, served.tmp) == 0


# -- WebSocket keys -------------------------------------------------------------------------------------------------
async def _ws_close(url: str, **kwargs) -> tuple[int, str, str | None]:
    """(close code, reason, selected subprotocol) of a session that sends nothing."""
    import websockets

    async with websockets.connect(url, open_timeout=20, **kwargs) as ws:
        try:
            await asyncio.wait_for(ws.recv(), 20)
        except websockets.ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason, ws.subprotocol


def test_websocket_keys_and_refusal_code(served):
    """Without a (valid) key a WebSocket is accepted and closed with 1008 "unauthorized" (as the close-code table
    says; it used to be refused with HTTP 403 at the handshake, which a browser cannot even read). A key in the
    ``specstream.key.<base64url>`` subprotocol, a Bearer header or ``?token=`` passes the check (here the session
    is then refused with 1013, since this server loaded no speech model); the server selects the plain
    ``specstream`` subprotocol and never echoes the key's."""
    url = f"ws://127.0.0.1:{served.port}/v1/subtitles"
    wrong = base64.urlsafe_b64encode(b"guessed-key").decode().rstrip("=")

    async def main():
        return {
            "none": await _ws_close(url),
            "wrong token": await _ws_close(url + "?token=guessed-key"),
            "wrong subprotocol": await _ws_close(url, subprotocols=["specstream", f"specstream.key.{wrong}"]),
            "subprotocol": await _ws_close(url, subprotocols=["specstream", f"specstream.key.{KEY_B64}"]),
            "bearer": await _ws_close(url, additional_headers={"Authorization": f"Bearer {KEY}"}),
            "token": await _ws_close(url + f"?token={KEY}"),
        }

    got = asyncio.run(main())
    assert got["none"] == (1008, "unauthorized", None)
    assert got["wrong token"] == (1008, "unauthorized", None)
    assert got["wrong subprotocol"] == (1008, "unauthorized", "specstream")
    assert got["subprotocol"] == (1013, "not ready", "specstream")
    assert got["bearer"] == got["token"] == (1013, "not ready", None)


def test_subtitles_page_sends_the_key_as_a_subprotocol_in_chromium(served):
    """The page opened as ``/subtitles?token=KEY`` drops the key from its address and from the WebSocket URL and
    sends it as a subprotocol: the socket passes the key check (1013: no speech model here, not 1008)."""
    if shutil.which("chromium") is None:
        pytest.fail("Debian chromium is required (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            urls = []
            page.on("websocket", lambda ws: urls.append(ws.url))
            assert page.goto(served.base + f"/subtitles?token={KEY}&speed=2").status == 200
            assert page.evaluate("location.search") == "?speed=2"
            code, reason, protocol = page.evaluate("""async () => {
                const s = await openSocket(48000);
                return await new Promise((r) => s.addEventListener("close", (e) => r([e.code, e.reason, s.protocol])));
            }""")
        finally:
            browser.close()
    assert (code, reason, protocol) == (1013, "not ready", "specstream")
    assert urls == [f"ws://127.0.0.1:{served.port}/v1/subtitles"]


def test_credentials_never_reach_the_logs(served):
    """Every credential channel, right and wrong keys, at uvicorn's most verbose level (``trace`` logs each ASGI
    scope with its headers): the served process's log holds the request lines with ``token=***`` and none of the
    keys, raw or base64url."""
    import httpx
    import websockets

    wrong_b64 = base64.urlsafe_b64encode(b"guessed-key-2").decode().rstrip("=")
    assert httpx.get(served.base + f"/healthz?token={KEY}").status_code == 200
    assert httpx.get(served.base + "/healthz?token=guessed-key-1").status_code == 401
    assert httpx.get(served.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(served.base + "/metrics", headers={"Authorization": "Bearer guessed-key-3"}).status_code == 401
    url = f"ws://127.0.0.1:{served.port}/v1/subtitles"

    async def sockets():
        for path, protocols in ((f"?token={KEY}", None), ("?token=guessed-key-4", None),
                                ("", ["specstream", f"specstream.key.{KEY_B64}"]),
                                ("", ["specstream", f"specstream.key.{wrong_b64}"])):
            try:
                await _ws_close(url + path, subprotocols=protocols)
            except websockets.InvalidStatus:  # a handshake refused with an HTTP status: logged all the same
                pass

    asyncio.run(sockets())
    time.sleep(0.5)
    logs = served.logs()
    assert '"GET /healthz?token=*** HTTP/1.1" 200' in logs and '"GET /healthz?token=*** HTTP/1.1" 401' in logs
    assert '"WebSocket /v1/subtitles?token=***"' in logs, logs[-3000:]
    assert "Bearer ***" in logs  # trace lines carry the headers
    for secret in (KEY, KEY_B64, "guessed-key-1", "guessed-key-3", "guessed-key-4", wrong_b64):
        assert secret not in logs, secret
