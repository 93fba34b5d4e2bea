"""specstream: multimodal streaming inference with token-tree speculative decoding.

The public API is small; see README.md. Heavy modules are imported lazily.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
