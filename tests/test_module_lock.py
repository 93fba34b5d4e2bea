"""``tests/module_lock.py``: an exclusive module waiting for the lock goes before shared modules that ask after it
(else the other xdist worker's chain of shared modules can keep it waiting for minutes)."""

from __future__ import annotations

import fcntl
import threading
import time

from module_lock import module_lock


def _try_shared(path: str) -> bool:
    """Whether a shared request made now would pass the turnstile without waiting."""
    with open(path + ".turnstile", "a") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(gate, fcntl.LOCK_UN)
        return True


def test_a_waiting_exclusive_module_goes_before_later_shared_ones(tmp_path):
    path = str(tmp_path / "run.lock")
    order: list[str] = []
    running = module_lock(path, exclusive=False)  # the other worker's module, in progress
    running.__enter__()
    assert _try_shared(path)  # nobody waits: shared modules pass

    def exclusive():
        with module_lock(path, exclusive=True):
            order.append("exclusive")

    waiter = threading.Thread(target=exclusive)
    waiter.start()
    deadline = time.monotonic() + 10
    while _try_shared(path) and time.monotonic() < deadline:  # until the exclusive request holds the turnstile
        time.sleep(0.01)
    assert not _try_shared(path), "a shared module asking now would overtake the waiting exclusive one"
    assert order == []  # still waiting for the running module

    def later_shared():
        with module_lock(path, exclusive=False):
            order.append("shared")

    later = threading.Thread(target=later_shared)
    later.start()
    time.sleep(0.2)
    assert order == []  # the later shared module waits too
    running.__exit__(None, None, None)
    waiter.join(10)
    later.join(10)
    assert order == ["exclusive", "shared"]
    assert _try_shared(path)


def test_exclusive_modules_are_collected_first_in_their_order():
    """The suite's collection order: a module that prepares beside the others first, then the largest ordinary
    module, then the other ``exclusive`` modules (without a prepared one: those first), then the other modules
    with more tests first; a module's tests stay together and in their order. xdist's own reorder (by number of tests, which put the exclusive modules in the middle of the run)
    is off, so this order is the order modules are handed out in."""
    import types
    import tomllib
    from pathlib import Path

    import conftest

    plain, prepared = types.ModuleType("plain"), types.ModuleType("prepared")
    prepared.prepare_before_exclusive = lambda: None

    class Item:
        def __init__(self, nodeid, exclusive, module=plain):
            self.nodeid, self.exclusive, self.module = nodeid, exclusive, module

        def get_closest_marker(self, name):
            return object() if name == "exclusive" and self.exclusive else None

    items = [Item("a.py::1", False), Item("w.py::1", True, prepared), Item("b.py::1", True), Item("a.py::2", False),
             Item("c.py::1", False), Item("c.py::2", False), Item("c.py::3", False), Item("d.py::1", True),
             Item("w.py::2", True, prepared), Item("d.py::2", True)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["w.py::1", "w.py::2", "c.py::1", "c.py::2", "c.py::3", "d.py::1",
                                         "d.py::2", "b.py::1", "a.py::1", "a.py::2"]
    without = [i for i in items if i.module is plain]
    conftest.pytest_collection_modifyitems(None, without)
    assert [i.nodeid for i in without] == ["d.py::1", "d.py::2", "b.py::1", "c.py::1", "c.py::2", "c.py::3",
                                           "a.py::1", "a.py::2"]
    addopts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
        "tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "--dist" in addopts and "loadscope" in addopts and "--no-loadscope-reorder" in addopts
