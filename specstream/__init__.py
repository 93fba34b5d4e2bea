"""specstream: multimodal streaming inference with token-tree speculative decoding.

The public API is small; see README.md. Heavy modules are imported lazily.
"""

import os

__version__ = "0.1.0"

# OpenMP threads that spin while waiting (libgomp's default) make every parallel region of a CPU forward wait for
# a descheduled sibling when another process shares the cores; measured with the real 1.5B/0.5B pair on a loaded
# 2-core machine: 48 s (default) and 65 s (ACTIVE) against 7.7 s (PASSIVE) for the same 20 tokens. Set before
# torch is imported; a value the user set wins. (docs/performance.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["__version__"]
