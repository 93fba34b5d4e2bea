"""Check a Docker Compose file where the ``docker compose`` plugin is absent (``docker compose config`` does more
where it is installed): ``python scripts/check_compose.py [deploy/docker-compose.yml]``.

What is checked, with PyYAML and the project's own parsers (run it in the project's virtual environment):

- the file is YAML with a ``services`` mapping; each service has an ``image`` or a ``build`` whose context
  directory and Dockerfile exist (paths relative to the compose file, as Compose resolves them);
- each volume is a bind mount whose host path exists, or a named volume declared under top-level ``volumes``;
- ``depends_on`` names services of the file; ``ports`` are ``HOST:CONTAINER`` port numbers;
- the ``command`` of each service built from this repository parses with the parser of that ``specstream``
  subcommand (``worker``, ``serve``) and turns into its settings with the service's ``environment``.

Prints one line per problem and exits 1, or prints ``ok: ...`` and exits 0.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import yaml


def _bind_source(volume) -> str | None:
    """The host path of a bind mount (short ``SRC:DST[:MODE]`` or long ``{type: bind, source}`` syntax), or None
    for a named volume."""
    if isinstance(volume, dict):
        return volume.get("source") if volume.get("type") == "bind" else None
    src = str(volume).split(":")[0]
    return src if src.startswith((".", "/", "~")) else None


def _named(volume) -> str | None:
    if isinstance(volume, dict):
        return volume.get("source") if volume.get("type", "volume") == "volume" else None
    parts = str(volume).split(":")
    return parts[0] if len(parts) > 1 and not parts[0].startswith((".", "/", "~")) else None


def _parse_command(argv: list[str], env: dict) -> str | None:
    """None when ``specstream ARGV`` parses and gives settings with ``env``; else why not."""
    from specstream.cli import PASSTHROUGH

    target = PASSTHROUGH.get((argv[0],)) if argv else None
    if target is None or not hasattr(importlib.import_module(target[1].split(":")[0]), "settings_from_args"):
        return None  # not a long-running command with settings: nothing more to check
    module = importlib.import_module(target[1].split(":")[0])
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPECSTREAM_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: str(v) for k, v in env.items()})
        try:
            module.settings_from_args(module.build_parser().parse_args(argv[1:]))
        except SystemExit:
            return f"`specstream {' '.join(argv)}` does not parse (usage message above)"
        except Exception as exc:  # a settings error: a bad value in the service's environment
            return f"`specstream {' '.join(argv)}`: {type(exc).__name__}: {exc}"
        return None
    finally:
        for key in [k for k in os.environ if k.startswith("SPECSTREAM_")]:
            del os.environ[key]
        os.environ.update(saved)


def check(path: str | os.PathLike) -> list[str]:
    """The problems of the compose file at ``path`` (empty: none found).

    Raises:
        OSError: the file cannot be read. yaml.YAMLError: it is not YAML.
    """
    path = Path(path)
    base = path.parent
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        return [f"{path}: no services mapping"]
    services = data["services"]
    declared = set(data.get("volumes") or {})
    problems = []
    for name, svc in services.items():
        where = f"{path}: services.{name}"
        build = svc.get("build")
        if build is None and "image" not in svc:
            problems.append(f"{where}: neither image nor build")
        if build is not None:
            context, dockerfile = (build, "Dockerfile") if isinstance(build, str) else (
                build.get("context", "."), build.get("dockerfile", "Dockerfile"))
            ctx = base / context
            if not ctx.is_dir():
                problems.append(f"{where}.build.context: {ctx} is not a directory")
            elif not (ctx / dockerfile).is_file():
                problems.append(f"{where}.build.dockerfile: {ctx / dockerfile} does not exist")
        for volume in svc.get("volumes") or []:
            src = _bind_source(volume)
            if src is not None and not (base / Path(src).expanduser()).exists():
                problems.append(f"{where}.volumes: the bind-mount source {base / src} does not exist")
            named = _named(volume)
            if named is not None and named not in declared:
                problems.append(f"{where}.volumes: named volume {named!r} is not declared under volumes")
        deps = svc.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else list(deps):
            if dep not in services:
                problems.append(f"{where}.depends_on: no service {dep!r}")
        for port in svc.get("ports") or []:
            if not re.fullmatch(r"(\d+:)?\d+(/(tcp|udp))?", str(port)):
                problems.append(f"{where}.ports: {port!r} is not HOST:CONTAINER")
        command = svc.get("command")
        if build is not None and isinstance(command, list):
            why = _parse_command([str(c) for c in command], svc.get("environment") or {})
            if why:
                problems.append(f"{where}.command: {why}")
    return problems


def main(argv: list[str]) -> int:
    path = argv[0] if argv else str(Path(__file__).resolve().parent.parent / "deploy" / "docker-compose.yml")
    try:
        problems = check(path)
    except (OSError, yaml.YAMLError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"ok: {path} ({', '.join(yaml.safe_load(Path(path).read_text())['services'])})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
