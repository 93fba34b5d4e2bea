"""deploy/ files parse and name what the worker expects (docker is not runnable here)."""

from pathlib import Path

import yaml

DEPLOY = Path(__file__).parent.parent / "deploy"


def test_compose_kafka_kraft_worker_api():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"kafka", "worker", "api"} <= set(services)
    env = services["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller" and "KAFKA_CONTROLLER_QUORUM_VOTERS" in env
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    cmd = services["worker"]["command"]
    assert cmd[0] == "worker" and "kafka://kafka:9092" in cmd
    assert services["worker"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["worker"]["build"]["dockerfile"] == "deploy/Dockerfile"


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
    assert container["args"][0] == "worker"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 120


def test_dockerfile_installs_kafka_extra():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "kafka" in text and 'ENTRYPOINT ["specstream"]' in text
