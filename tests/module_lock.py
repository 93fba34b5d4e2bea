"""The lock that keeps an ``exclusive`` test module alone on the machine (see ``conftest._module_lock``).

Every module holds the run's lock file: shared for ordinary modules, exclusive for the marked ones. ``flock``
alone gives a waiting exclusive request no preference: the other xdist worker releases its shared lock at the end
of a module and takes it again for its next one, so the exclusive worker could wait through many modules (the
CI runs logged up to 400 s of setup wait). A second file is the turnstile in front of it, the writer preference
of a readers-writer lock: an exclusive request takes the turnstile first and keeps it, so no new shared request
gets past while it waits for the running module to end; a shared request passes through the turnstile (takes
and drops it) before it takes its shared lock.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator


@contextlib.contextmanager
def module_lock(path: str, exclusive: bool) -> Iterator[None]:
    """Hold the run's lock ``path`` (shared, or ``exclusive``) for the body; ``path + ".turnstile"`` gives a
    waiting exclusive request precedence over shared requests made after it. Closing a file drops its ``flock``,
    so leaving the body (or an error) releases both."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(path + ".turnstile", "a") as gate, open(path, "a") as lock:
        fcntl.flock(gate, mode)
        fcntl.flock(lock, mode)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)  # a shared request only passes through; an exclusive one keeps it
        yield
