"""Every HTTP route fuzzed from its own OpenAPI schema with schemathesis, in-process over ASGI (schemathesis runs
the app's lifespan: the speech model loads, the device loop runs, the tiny VLM serves chats that get through).

Checked for every generated request (valid ones from the schema, and schemathesis' negative ones that break it):
no 5xx, the status code and content type are declared, the body matches the declared response schema, and no
request takes longer than ``REQUEST_BOUND_S``; after the run the process's RSS is back within 10% of where it was
after one warm-up request per route. The OpenAPI links that stateful testing follows do not exist here (no
route creates a resource another one reads), so there is no state machine to run.

``test_fuzz_every_route`` runs ``FUZZ_EXAMPLES`` examples per route (about a minute); the ``slow`` one runs
``SLOW_FUZZ_EXAMPLES`` (``pytest -m slow tests/test_api_fuzz.py``; the benchmarks' longer run).
"""

from __future__ import annotations

import os
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import CHECKS

FUZZ_EXAMPLES = 40
SLOW_FUZZ_EXAMPLES = 150
REQUEST_BOUND_S = 30.0  # one request, the slowest legal one included (a chat of max_tokens up to the context)
CHECK_NAMES = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "response_headers_conformance")
SEEN: dict[str, int] = {}  # requests per route
STATUSES: dict[int, int] = {}  # responses per status code


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def api_schema():
    from specstream.pipeline.server import ServerSettings, create_app

    app = create_app(ServerSettings(max_upload_bytes=1 << 20, idle_timeout_s=2.0))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


#: every HTTP route of the app (the last test checks that /openapi.json has exactly these)
ROUTES = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/subtitles"),
          ("POST", "/v1/captions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("GET", "/v1/models"), ("POST", "/v1/audio/transcriptions")]


def _checks():
    return [c for c in CHECKS.get_all() if c.__name__ in CHECK_NAMES]


def _run(case) -> None:
    t0 = time.monotonic()
    response = case.call_and_validate(checks=_checks())
    took = time.monotonic() - t0
    key = f"{case.method.upper()} {case.path}"
    SEEN[key] = SEEN.get(key, 0) + 1
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    assert took < REQUEST_BOUND_S, f"{key} took {took:.1f} s (bound {REQUEST_BOUND_S} s)"
    assert response.status_code < 500


def _fuzz(api_schema, method: str, path: str, examples: int, derandomize: bool) -> None:
    from hypothesis import given
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    op = api_schema[path][method]
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @given(case=strategy)
    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case):
        _run(case)

    run()


def test_openapi_describes_the_request_models(api_schema):
    raw = api_schema.raw_schema
    assert raw["openapi"].startswith("3.1")
    chat = raw["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    assert {"200", "400", "404", "429"} <= set(chat["responses"])
    comps = raw["components"]["schemas"]
    assert {"messages", "model", "n", "max_tokens", "temperature"} <= set(comps["ChatRequest"]["properties"])
    assert {"prompt", "model", "n"} <= set(comps["CompletionRequest"]["properties"])
    form = raw["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["required"] == ["file", "model"]


@pytest.fixture(scope="module")
def baseline_rss(api_schema):
    """RSS after one request per route (the models are loaded by then)."""
    from schemathesis.python import asgi

    app = api_schema.app
    with asgi.get_client(app) as client:
        for _ in range(600):
            ready = client.get("http://localhost/readyz")
            if ready.status_code == 200 or ready.json()["status"] == "failed":
                break
            time.sleep(0.2)
        assert ready.status_code == 200, ready.text
        r = client.post("http://localhost/v1/chat/completions",
                        json={"model": "specstream-tiny-llava", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        r = client.post("http://localhost/v1/completions", json={"model": "specstream-tiny-llava",
                                                                "max_tokens": 4, "prompt": "hi"})
        assert r.status_code == 200, r.text
    return _rss_bytes()


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_every_route(api_schema, baseline_rss, method, path):
    _fuzz(api_schema, method, path, FUZZ_EXAMPLES, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_every_route_long(api_schema, baseline_rss, method, path):
    _fuzz(api_schema, method, path, SLOW_FUZZ_EXAMPLES, derandomize=False)


def test_every_route_was_fuzzed_and_memory_came_back(api_schema, baseline_rss):
    import gc

    paths = {f"{m.upper()} {p}" for p, ops in api_schema.raw_schema["paths"].items() for m in ops}
    assert set(SEEN) == paths, (sorted(SEEN), sorted(paths))
    print(f"fuzzed {len(paths)} routes, {sum(SEEN.values())} requests: {SEEN}; statuses {STATUSES}")
    gc.collect()
    after = _rss_bytes()
    assert after <= 1.10 * baseline_rss, (after, baseline_rss)
