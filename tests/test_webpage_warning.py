"""The ``/subtitles`` page shows the server's ``warning`` event (issue 19, item 6; before, the page dropped it):
the page's own script in headless Chromium, its WebSocket answered by Playwright's WebSocket route with the
message a real :class:`StreamWarning` makes (the page is what is tested here; the server's warning has its own
test in test_live_rtf_warning.py)."""

from __future__ import annotations

import json
import wave

import pytest

from binaries import CHROMIUM_ARGS, require
from specstream.pipeline.webpage import SUBTITLES_HTML
from specstream.stages.streaming import StreamWarning

pytestmark = pytest.mark.timeout(120)


def test_page_shows_the_warning_event(tmp_path):
    chromium = require("chromium")
    from playwright.sync_api import sync_playwright

    wav = tmp_path / "quiet.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\x00\x00" * 8000)  # 0.5 s
    warning = StreamWarning("falling_behind", "decoding passes take 2.50 s per 1.00 s of audio", 2.5, 2.5, 1.0,
                            3.0).message()
    seen = []

    def handler(ws):
        def on_message(text):
            m = json.loads(text) if isinstance(text, str) else {"type": "audio"}
            seen.append(m["type"])
            if m["type"] == "start":
                ws.send(json.dumps(warning))
            elif m["type"] == "stop":
                ws.send(json.dumps({"type": "done"}))
        ws.on_message(on_message)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=[*CHROMIUM_ARGS, "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page()
            page.route("http://specstream.test/subtitles*",
                       lambda route: route.fulfill(status=200, content_type="text/html", body=SUBTITLES_HTML))
            page.route_web_socket("ws://specstream.test/v1/subtitles", handler)
            page.goto("http://specstream.test/subtitles?speed=4")
            assert page.locator("#warning").text_content() == ""
            page.set_input_files("#file", str(wav))
            page.click("#play")
            page.wait_for_function("document.querySelector('#status').textContent.startsWith('done')",
                                   timeout=30_000)
            shown = page.locator("#warning").text_content()
            code = page.locator("#warning").get_attribute("data-code")
            visible = page.locator("#warning").is_visible()
        finally:
            browser.close()
    assert seen[0] == "start" and seen[-1] == "stop"
    assert shown == "decoding passes take 2.50 s per 1.00 s of audio (real-time factor 2.5)"
    assert code == "falling_behind" and visible
