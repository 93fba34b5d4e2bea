"""Remote media URLs under ``--allowed-media-domains``, against an HTTP server on 127.0.0.1 that this test starts
(``http.server`` in a thread): listed hosts only, no redirect to an unlisted host, loopback only when the address
itself is listed, a size limit, a timeout; off (today's refusal) by default. The fetched image captions exactly as
the same image sent as a data URL."""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

VLM = "specstream-tiny-llava"


@pytest.fixture(scope="module")
def origin(src):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(src["astronaut"]).convert("RGB").resize((96, 96)).save(buf, "PNG")  # a real photo, small
    png = buf.getvalue()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            port = self.server.server_address[1]
            routes = {"/cat.png": (200, png), "/missing.png": (404, b"no"),
                      "/big.png": (200, b"\x89PNG" + b"\x00" * 300_000)}
            if self.path == "/here":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
            elif self.path == "/away":  # the same server under a name that is not listed
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/cat.png")
                self.end_headers()
            elif self.path == "/slow.png":
                time.sleep(3)
                self.send_response(200)
                self.end_headers()
            elif self.path in routes:
                code, body = routes[self.path]
                self.send_response(code)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404)
                self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", png
    srv.shutdown()
    srv.server_close()


def test_policy_on_the_fetcher(origin):
    from specstream.errors import InvalidRequestError, MediaFetchError, MediaUrlNotAllowedError
    from specstream.modalities.fetch import FetchPolicy, fetch

    base, png = origin
    port = base.rsplit(":", 1)[1]
    ok = FetchPolicy(("127.0.0.1",), max_bytes=200_000, timeout_s=1.5)
    assert fetch(f"{base}/cat.png", ok) == (png, "image/png")
    assert fetch(f"{base}/here", ok)[0] == png  # a redirect within the listed host
    with pytest.raises(MediaUrlNotAllowedError, match="'localhost' is not in the allowed media domains"):
        fetch(f"{base}/away", ok)
    with pytest.raises(MediaUrlNotAllowedError, match="resolves to 127.0.0.1"):  # a listed name, loopback address
        fetch(f"http://localhost:{port}/cat.png", FetchPolicy(("localhost",)))
    with pytest.raises(MediaUrlNotAllowedError, match="not in the allowed"):
        fetch(f"{base}/cat.png", FetchPolicy(("example.com",)))
    with pytest.raises(MediaUrlNotAllowedError, match="only http and https"):
        fetch("ftp://127.0.0.1/cat.png", ok)
    with pytest.raises(InvalidRequestError, match="over 200000"):
        fetch(f"{base}/big.png", ok)
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        fetch(f"{base}/missing.png", ok)
    t0 = time.monotonic()
    with pytest.raises(MediaFetchError, match="took over 1.5 s"):
        fetch(f"{base}/slow.png", ok)
    assert time.monotonic() - t0 < 2.5


@pytest.fixture(scope="module")
def chat(origin):
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    apps = {}
    for name, domains in (("on", ["127.0.0.1"]), ("off", [])):
        app = create_app(ServerSettings(allowed_media_domains=domains, max_upload_bytes=250_000,
                                        media_fetch_timeout_s=1.5))
        app.state.specstream.loop.start()  # the device loop without the lifespan: no speech model needed
        apps[name] = (app, TestClient(app))
    yield {k: v[1] for k, v in apps.items()}
    for app, _ in apps.values():
        app.state.specstream.loop.stop(30.0)


def _ask(client, url: str):
    body = {"model": VLM, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "Describe this image."}]}]}
    return client.post("/v1/chat/completions", json=body)


def test_chat_fetches_listed_hosts_only(chat, origin):
    base, png = origin
    fetched = _ask(chat["on"], f"{base}/cat.png")
    assert fetched.status_code == 200, fetched.text
    inline = _ask(chat["on"], "data:image/png;base64," + base64.b64encode(png).decode())
    assert fetched.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
    for url, status, code in ((f"{base}/away", 400, "media_url_not_allowed"),
                              (f"{base}/big.png", 400, "invalid_request"),
                              (f"{base}/missing.png", 400, "media_fetch_failed"),
                              (f"{base}/slow.png", 400, "media_fetch_failed")):
        res = _ask(chat["on"], url)
        err = res.json()["error"]
        assert (res.status_code, err["code"], err["param"]) == (status, code, "messages.0.content.0"), res.text
    off = _ask(chat["off"], f"{base}/cat.png")
    assert off.status_code == 400 and off.json()["error"]["code"] == "unsupported_parameter"
    assert "does not fetch http URLs" in off.json()["error"]["message"]
