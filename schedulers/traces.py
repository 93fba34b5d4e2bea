"""Synthetic request traces (seeded, deterministic) for the simulator, its tests and the benchmark.

Each class arrives as a Poisson process at its own rate. Shapes follow the three workloads of the design:
``realtime`` = live subtitles (audio windows, short outputs, 1-s deadline), ``interactive`` = captioning over
HTTP/Kafka (one or two keyframes, 10-s deadline), ``batch`` = video QA / bulk captioning (several keyframes,
long outputs, 10-min deadline).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from specstream.schedulers.simulator import TraceEvent


@dataclass(frozen=True)
class ClassLoad:
    """Arrivals of one class: ``rate_per_s`` over ``[start_s, end_s)`` and the request shape."""

    qos: str
    rate_per_s: float
    start_s: float = 0.0
    end_s: float = 60.0
    deadline_ms: float = 1000.0
    prompt_tokens: tuple[int, int] = (32, 64)
    max_new_tokens: tuple[int, int] = (16, 32)
    images: tuple[int, int] = (0, 0)
    audio_s: float = 0.0
    acceptance: float = 0.7


REALTIME = ClassLoad("realtime", 2.0, deadline_ms=1000.0, prompt_tokens=(24, 48), max_new_tokens=(8, 16),
                     audio_s=2.0, acceptance=0.8)
INTERACTIVE = ClassLoad("interactive", 1.0, deadline_ms=10_000.0, prompt_tokens=(64, 128),
                        max_new_tokens=(24, 48), images=(1, 2), acceptance=0.7)
BATCH = ClassLoad("batch", 2.0, deadline_ms=600_000.0, prompt_tokens=(96, 192), max_new_tokens=(48, 96),
                  images=(2, 6), acceptance=0.6)


def synthetic_trace(loads: list[ClassLoad], seed: int = 0) -> list[TraceEvent]:
    """Poisson arrivals per class, merged in time order; ids ``{qos}-{n}``."""
    rng = random.Random(seed)
    events = []
    for load in loads:
        t, n = load.start_s, 0
        if load.rate_per_s <= 0:
            continue
        while True:
            t += rng.expovariate(load.rate_per_s)
            if t >= load.end_s:
                break
            events.append(TraceEvent(
                t_ms=round(t * 1000.0, 3), id=f"{load.qos}-{n}", qos=load.qos, deadline_ms=load.deadline_ms,
                prompt_tokens=rng.randint(*load.prompt_tokens), max_new_tokens=rng.randint(*load.max_new_tokens),
                images=rng.randint(*load.images), audio_s=load.audio_s, acceptance=load.acceptance))
            n += 1
    return sorted(events, key=lambda e: (e.t_ms, e.id))


def write_trace(events: list[TraceEvent], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in events))
    return path
