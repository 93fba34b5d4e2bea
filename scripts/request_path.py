"""Which of our files run on the way from ``specstream caption`` to the first device step.

``python scripts/request_path.py INPUT...`` runs ``specstream caption INPUT... --max-new-tokens 2`` in process with
a profile hook on every thread, and prints, in the order first entered, each of our source files one of whose functions (not its import) ran before
the device loop's first ``DeviceLoop.step`` (the files of the shared step core are marked ``core``). Child
processes (the video decoder, ``modalities/_video_worker.py``) are not traced. docs/architecture.md ("Request
paths") quotes its output.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

ROOTS = ("specstream", "pipeline", "stages", "schedulers", "modalities", "kernels")
CORE = ("schedulers/qos.py", "stages/speculative/executor.py", "stages/speculative/tree.py",
        "stages/speculative/models/llama.py", "stages/speculative/models/kv_cache.py", "kernels/verification.py",
        "kernels/sampling.py")


def main(argv: list[str]) -> int:
    import specstream

    repo = os.path.dirname(os.path.dirname(os.path.abspath(specstream.__file__)))
    seen: dict[str, None] = {}
    done = threading.Event()

    def hook(frame, event, arg):
        if done.is_set() or event != "call" or frame.f_code.co_name == "<module>":
            return  # module bodies (imports) do not count: only files whose functions run
        path = frame.f_code.co_filename
        if not path.startswith(repo + os.sep):
            return
        rel = os.path.relpath(path, repo)
        if rel.split(os.sep)[0] not in ROOTS:
            return
        if rel == os.path.join("stages", "device_loop.py") and frame.f_code.co_name == "step":
            done.set()
            sys.setprofile(None)
            return
        seen.setdefault(rel, None)

    threading.setprofile(hook)
    sys.setprofile(hook)
    from specstream.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        code = cli(["caption", *argv, "--out", os.path.join(tmp, "out.jsonl"), "--max-new-tokens", "2",
                    "--no-progress"])
    sys.setprofile(None)
    threading.setprofile(None)
    files = list(seen)
    for n, rel in enumerate(files, 1):
        print(f"{n:3d} {rel}{'  core' if rel in CORE else ''}")
    print(f"{len(files)} files before the first device step, {sum(f not in CORE for f in files)} outside the "
          f"step core (exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
