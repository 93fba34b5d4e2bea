"""Request paths stay short (issue 20): ``scripts/request_path.py``'s submit chain, tested.

The submit chain is the files of ours on the call stack of the frame that hands a request to the device loop, from
the entry down, with the stacks that spawned asyncio tasks, threads and thread-pool work items put in front
(docs/architecture.md, "Request paths"). First the chain walker itself, on a small package written here whose
request crosses a task, a thread-pool hop and a thread; then one real path, ``specstream caption photo.png`` run
in process with the built-in tiny models, whose chain must stay at most 6 files and be the one the docs list, so
a pass-through layer added on the way fails here.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from media import sources

ROOT = Path(__file__).resolve().parents[1]
CAPTION_CHAIN = ["specstream/cli.py", "pipeline/caption_job.py", "stages/caption.py", "stages/device_loop.py"]


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("request_path_script", ROOT / "scripts" / "request_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, code in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(textwrap.dedent(code))


def _load(repo: Path, rel: str, name: str, **names):
    """Import ``repo/rel`` as module ``name`` (its frames carry that file name) with ``names`` as globals."""
    spec = importlib.util.spec_from_file_location(name, repo / rel)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(names)
    spec.loader.exec_module(module)
    return module


def _fake_request(rp, repo: Path, through: bool) -> list[str]:
    """A request written as in the product: an entry that runs an event loop and spawns a task, a stage whose
    task hops to a thread pool (``asyncio.to_thread``), then to a thread, whose code hands the request to the
    loop. ``through``: a pass-through module sits between the stage and the loop. Returns the chain's files."""
    _write(repo, {
        "stages/device_loop.py": """
            class DeviceLoop:
                def submit_threadsafe(self, request):
                    return request
            """,
        "stages/relay.py": """
            def forward(loop, request):
                return loop.submit_threadsafe(request)
            """,
        "stages/stage.py": """
            import asyncio
            import threading

            def _in_thread(loop, request, out):
                out.append(relay.forward(loop, request) if relay else loop.submit_threadsafe(request))

            def _in_pool(loop, request):
                out = []
                t = threading.Thread(target=_in_thread, args=(loop, request, out))
                t.start()
                t.join()
                return out[0]

            async def handle(loop, request):
                return await asyncio.to_thread(_in_pool, loop, request)
            """,
        "modalities/helper.py": """
            def normalise(request):
                return request.lower()
            """,
        "pipeline/entry.py": """
            import asyncio

            async def _main(loop):
                request = helper.normalise("R1")  # a helper called and returned: not on the chain
                task = asyncio.create_task(stage.handle(loop, request))
                return await task

            def main(loop):
                return asyncio.run(_main(loop))
            """,
    })
    dl = _load(repo, "stages/device_loop.py", "fake_device_loop")
    relay = _load(repo, "stages/relay.py", "fake_relay") if through else None
    stage = _load(repo, "stages/stage.py", "fake_stage", relay=relay)
    helper = _load(repo, "modalities/helper.py", "fake_helper")
    entry = _load(repo, "pipeline/entry.py", "fake_entry", stage=stage, helper=helper)
    walk = rp.Walk(str(repo))
    walk.armed.set()
    with walk.installed():
        assert entry.main(dl.DeviceLoop()) == "r1"
    assert len(walk.handoffs) == 1
    assert "modalities/helper.py" in walk.before  # it ran (all files entered), but returned before the hand-off
    return list(rp.chain_files(walk.submit_chain))


def test_the_chain_follows_tasks_pool_hops_and_threads_back_to_the_entry(rp, tmp_path):
    direct = _fake_request(rp, tmp_path / "direct", through=False)
    assert direct == ["pipeline/entry.py", "stages/stage.py", "stages/device_loop.py"]
    # the hand-off thread's own stack alone knows nothing of the entry: the links put it there
    relayed = _fake_request(rp, tmp_path / "relayed", through=True)
    assert relayed == ["pipeline/entry.py", "stages/stage.py", "stages/relay.py", "stages/device_loop.py"]


def test_chain_files_keeps_each_file_once_in_first_order(rp):
    chain = [("a.py", "f"), ("b.py", "g"), ("a.py", "h"), ("c.py", "i"), ("b.py", "g")]
    assert rp.chain_files(chain) == {"a.py": ["f", "h"], "b.py": ["g"], "c.py": ["i"]}


def test_caption_cli_submit_chain_is_at_most_six_files_and_the_documented_one(rp, tmp_path):
    image = tmp_path / "photo.png"
    image.write_bytes(Path(sources()["astronaut"]).read_bytes())
    assert rp.run_caption(rp.Walk(str(ROOT)), [str(image)]) == 0  # imports and first-use probes, not traced
    walk = rp.Walk(str(ROOT))
    with walk.installed():
        assert rp.run_caption(walk, [str(image)]) == 0
    files = list(rp.chain_files(walk.submit_chain))
    outside = [f for f in files if f not in rp.CORE]
    assert len(outside) <= 6, files
    assert files == CAPTION_CHAIN, f"{files}: docs/architecture.md (Request paths) lists {CAPTION_CHAIN}"
    assert walk.stepped.is_set()
    assert sys.getprofile() is None
