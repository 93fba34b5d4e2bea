"""``/docs`` renders in a real browser, offline: headless Chromium (the Debian binary, driven by playwright) loads
the page, every request it makes is answered by the app in-process (nothing else is reachable), and every
operation of ``/openapi.json`` is listed on the rendered page. Before: the bundled Swagger UI 4.15 could not
read FastAPI's OpenAPI 3.1 and showed "Unable to render this definition"."""

from __future__ import annotations

import shutil

import pytest

from binaries import CHROMIUM_ARGS

BASE = "http://specstream.test"


def test_docs_page_lists_every_operation_in_chromium():
    if shutil.which("chromium") is None:
        pytest.fail("Debian chromium is required (apt-get install chromium)")
    from fastapi.testclient import TestClient
    from playwright.sync_api import sync_playwright

    from specstream.pipeline.server import ServerSettings, create_app

    client = TestClient(create_app(ServerSettings()), base_url=BASE)  # no lifespan: no model is loaded
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    expected = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    assert len(expected) >= 8
    served, foreign = [], []

    def answer(route):
        url = route.request.url
        if not url.startswith(BASE):
            foreign.append(url)
            return route.abort()
        res = client.request(route.request.method, url[len(BASE):])
        served.append(url[len(BASE):])
        route.fulfill(status=res.status_code, body=res.content,
                      headers={k: v for k, v in res.headers.items() if k.lower() != "content-length"})

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route("**/*", answer)
            assert page.goto(BASE + "/docs").status == 200
            page.wait_for_selector(".opblock, .errors-wrapper, .version-pragma", timeout=30_000)
            errors = page.locator(".errors-wrapper, .version-pragma").all_inner_texts()
            listed = page.evaluate("""() => [...document.querySelectorAll('.opblock')].map(b => [
                b.querySelector('.opblock-summary-method').innerText.trim(),
                b.querySelector('.opblock-summary-path').getAttribute('data-path')])""")
        finally:
            browser.close()
    assert not errors, errors
    assert {(m, p) for m, p in listed} == expected
    assert len(listed) == len(expected)
    assert not foreign, foreign  # no CDN, no other host
    assert "/openapi.json" in served and "/docs/assets/swagger-ui-bundle.js" in served
