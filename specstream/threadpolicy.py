"""The process's OpenMP wait policy, set where the process starts its engine, never as a side effect of import.

OpenMP threads that spin while waiting (libgomp's default) make every parallel region of a CPU forward wait for a
descheduled sibling when another process shares the cores; measured with the real 1.5B/0.5B pair on a loaded
2-core machine: 48 s (default) and 65 s (ACTIVE) against 7.7 s (PASSIVE) for the same 20 tokens. libgomp reads
``OMP_WAIT_POLICY`` once, when torch loads it (``import torch``), so :func:`set_thread_policy` must run before
that: the CLI calls it first thing (``specstream.cli.main``), the public API (``specstream.caption``,
``transcribe``, ``answer``, ``Engine``) before it imports torch, and the device loop when it starts (then it still
reaches the child processes the loop's process starts). A value the user set wins.
"""

from __future__ import annotations

import os
import sys

__all__ = ["set_thread_policy"]


def set_thread_policy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already names a policy.

    Returns True when this process's OpenMP runtime will read the policy (torch is not imported yet), False when
    it comes too late for this process (child processes started from now on still inherit it).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules
