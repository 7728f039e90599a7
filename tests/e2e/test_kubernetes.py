"""deploy/kubernetes rendered by kustomize (`kubectl kustomize`), every object checked against the
Kubernetes schemas of two versions, and the services' configuration checked against their option
declarations, as test_compose_env.py does for compose.yaml."""

from __future__ import annotations

import base64
import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
# The oldest version that runs sidecar containers (the worker is one) without a feature gate, and the
# newest whose schemas kubernetes-validate ships.
VERSIONS = ("1.29", "1.37")
# What is applied: each overlay, alone and with the in-cluster Redis.
RENDERS = ("cpu", "gpu", "cpu+redis", "gpu+redis")
SERVICES = ("gateway", "scheduler", "worker")


# --- rendering --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each of RENDERS as kustomize builds it: the objects `kubectl apply -k` would send."""
    if shutil.which("kubectl") is None:
        # kubectl is on this project's machines (CI's too): there, its absence is a broken machine.
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed: the Kubernetes manifests cannot be rendered")
        pytest.skip("kubectl is not installed")
    renders = {}
    for name in RENDERS:
        overlay, _, component = name.partition("+")
        folder = KUBERNETES / "overlays" / overlay
        if component:  # an overlay of one's own, as docs/deployment.md shows it
            folder = tmp_path_factory.mktemp(name.replace("+", "-"))
            relative = os.path.relpath(KUBERNETES, folder)
            (folder / "kustomization.yaml").write_text(yaml.safe_dump({
                "resources": [f"{relative}/overlays/{overlay}"], "components": [f"{relative}/components/{component}"]}))
        renders[name] = kustomize(folder)
    return renders


def kustomize(folder: Path) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def named(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def pod_templates(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def all_containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def service_of(container: dict) -> str | None:
    """The pagedserve service a container runs (the image's entrypoint is `pagedserve`), else None."""
    args = container.get("args") or []
    return args[0] if args and args[0] in SERVICES else None


def pagedserve_container(objects: list[dict], service: str) -> tuple[dict, dict]:
    """The one container running the service, and its pod's spec."""
    (found,) = [(c, t["spec"]) for t in pod_templates(objects) for c in all_containers(t["spec"])
                if service_of(c) == service]
    return found


def environment(container: dict, objects: list[dict]) -> dict[str, tuple[str, str]]:
    """The container's variables: name -> (value, where from: 'ConfigMap NAME', 'Secret NAME' or 'env')."""
    found: dict[str, tuple[str, str]] = {}
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source["configMapRef" if kind == "ConfigMap" else "secretRef"]
        matches = named(objects, kind, ref["name"])
        assert matches or ref.get("optional"), f"{container['name']} reads the missing {kind} {ref['name']}"
        for obj in matches:
            for key, value in (obj.get("data") or {}).items():
                text = base64.b64decode(value).decode() if kind == "Secret" else value
                found[key] = (text, f"{kind} {ref['name']}")
    for variable in container.get("env", []):
        found[variable["name"]] = (variable.get("value", ""), "env")
    return found


def service_environment(objects: list[dict], service: str) -> dict[str, str]:
    container, _ = pagedserve_container(objects, service)
    return {key: value for key, (value, _) in environment(container, objects).items()}


# --- the objects are valid -----------------------------------------------------------------------

def schema_errors(obj: dict, version: str) -> list[str]:
    """What the Kubernetes schema of that version refuses in the object (strict: no unknown field)."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{obj['kind']}/{obj['metadata'].get('name')}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("render", RENDERS)
def test_every_object_is_valid_kubernetes(rendered, render, version):
    objects = rendered[render]
    assert len(objects) >= 12
    assert [error for obj in objects for error in schema_errors(obj, version)] == []


def test_the_schema_check_sees_a_wrong_object():
    budget = yaml.safe_load((KUBERNETES / "base" / "gateway-pdb.yaml").read_text())
    assert schema_errors(budget, VERSIONS[0]) == []
    budget["spec"]["maxUnavailabel"] = 1  # a typo, which Kubernetes would drop without a word
    assert "'maxUnavailabel' was unexpected" in schema_errors(budget, VERSIONS[0])[0]
    wrong_kind = {"apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget", "metadata": {"name": "x"}}
    assert "Couldn't find schema" in schema_errors(wrong_kind, VERSIONS[1])[0]  # removed in 1.25


@pytest.mark.parametrize("render", RENDERS)
def test_every_selector_and_reference_finds_its_object(rendered, render):
    objects = rendered[render]
    labels = [t["metadata"]["labels"] for t in pod_templates(objects)]

    def selects(selector: dict) -> bool:
        return any(selector.items() <= pod.items() for pod in labels)

    for obj in objects:
        spec, what = obj.get("spec", {}), f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(), what
        if obj["kind"] == "Service":
            assert selects(spec["selector"]), what
        if obj["kind"] == "PodDisruptionBudget":
            assert selects(spec["selector"]["matchLabels"]), what
        if obj["kind"] == "NetworkPolicy":
            assert selects(spec["podSelector"]["matchLabels"]), what
            peers = [peer["podSelector"]["matchLabels"] for rule in spec["ingress"] for peer in rule["from"]]
            assert all(map(selects, peers)), what
        if obj["kind"] == "StatefulSet":
            assert named(objects, "Service", spec["serviceName"]), what
        if obj["kind"] == "HorizontalPodAutoscaler":
            assert named(objects, spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"]), what


# --- configuration: the options' variables ---------------------------------------------------------

def options_by_service() -> dict:
    from pagedserve.serve_flags import service_options

    return service_options()


def misplaced(variables: dict[str, tuple[str, str]], service: str | None) -> list[str]:
    """The PAGEDSERVE_* variables that the service (None: not a pagedserve service) has no option for, and
    secret options read from anywhere but a Secret (a ConfigMap is readable by whoever may list them)."""
    options = {option.env: option for option in options_by_service().get(service, ())}
    wrong = []
    for name, (_, source) in variables.items():
        if not name.startswith("PAGEDSERVE_"):
            continue
        if name not in options:
            wrong.append(f"{name} ({source}): {service or 'this container'} has no such option")
        elif options[name].secret != source.startswith("Secret"):
            wrong.append(f"{name} ({source}): " + ("a secret option, not in a Secret" if options[name].secret
                                                   else "not a secret option, in a Secret"))
    return wrong


def test_the_variable_check_sees_a_wrong_variable():
    assert misplaced({"PAGEDSERVE_MAX_NUM_SEQS": ("8", "env"), "OMP_NUM_THREADS": ("2", "env")}, "worker") == []
    assert misplaced({"PAGEDSERVE_MAX_NUM_SEQ": ("8", "ConfigMap x")}, "worker") == [
        "PAGEDSERVE_MAX_NUM_SEQ (ConfigMap x): worker has no such option"]
    assert misplaced({"PAGEDSERVE_API_KEY": ("k", "ConfigMap x")}, "gateway") == [
        "PAGEDSERVE_API_KEY (ConfigMap x): a secret option, not in a Secret"]
    assert misplaced({"PAGEDSERVE_PORT": ("80", "env")}, None) == [
        "PAGEDSERVE_PORT (env): this container has no such option"]


@pytest.mark.parametrize("render", RENDERS)
def test_every_variable_is_an_option_of_its_service(rendered, render):
    """A variable no option has would be ignored without a word (a typo, or a flag renamed since)."""
    objects = rendered[render]
    wrong = [f"{c['name']}: {problem}" for t in pod_templates(objects) for c in all_containers(t["spec"])
             for problem in misplaced(environment(c, objects), service_of(c))]
    assert wrong == []
    for service in SERVICES:
        pagedserve_container(objects, service)  # each runs, once


@pytest.mark.parametrize("render", RENDERS)
def test_every_service_takes_its_values(rendered, render, monkeypatch):
    """Each service's flags read from its variables, as it reads them at start: a value it would refuse
    ends the program there."""
    from services.gateway.server import arguments_error
    from services.gateway.server import build_parser as gateway
    from services.scheduler.server import build_parser as scheduler
    from services.worker.server import build_parser as worker
    from shared.config import EngineConfig
    from shared.option_env import apply_env_defaults
    from shared.options import refusal

    for name in [name for name in os.environ if name.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)
    for service, build_parser in {"gateway": gateway, "scheduler": scheduler, "worker": worker}.items():
        with monkeypatch.context() as patch:
            for key, value in service_environment(rendered[render], service).items():
                patch.setenv(key, value)
            parser = build_parser()
            apply_env_defaults(parser)
            args = parser.parse_args([])
            problem = arguments_error(args) if service == "gateway" else refusal(EngineConfig, args)
            assert problem is None, f"{service}: {problem}"


@pytest.mark.parametrize("render", RENDERS)
def test_the_worker_and_the_scheduler_read_the_same_limits(rendered, render):
    """The worker sizes its memory for the largest step the scheduler's limits allow: both read every
    limit from one ConfigMap, and neither from anywhere else."""
    from shared.config import EngineConfig
    from shared.options import read_by

    objects = rendered[render]
    limits = {option.env for option in read_by(EngineConfig, "scheduler")}
    sources = []
    for service in ("scheduler", "worker"):
        variables = environment(pagedserve_container(objects, service)[0], objects)
        (source,) = {where for key, (_, where) in variables.items() if key in limits}
        assert limits <= set(variables), f"the {service} lacks {sorted(limits - set(variables))}"
        sources.append(source)
    assert sources[0] == sources[1] and sources[0].startswith("ConfigMap pagedserve-engine-limits")


# --- how the services find each other -------------------------------------------------------------

def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("render", RENDERS)
def test_the_gateways_list_every_model_replica(rendered, render):
    """The gateway's schedulers are the StatefulSet's pods, by their stable DNS names: one each, in order."""
    objects = rendered[render]
    (replicas,) = named(objects, "StatefulSet", "pagedserve-model")
    scheduler = service_environment(objects, "scheduler")
    (headless,) = named(objects, "Service", replicas["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    port = port_of(scheduler["PAGEDSERVE_LISTEN"])
    assert [p["port"] for p in headless["spec"]["ports"]] == [port]
    pods = [f"{replicas['metadata']['name']}-{i}" for i in range(replicas["spec"]["replicas"])]  # the pods' names
    expected = [f"{pod}.{headless['metadata']['name']}:{port}" for pod in pods]
    assert service_environment(objects, "gateway")["PAGEDSERVE_SCHEDULER"].split(",") == expected


@pytest.mark.parametrize("render", RENDERS)
def test_each_scheduler_drives_the_worker_beside_it(rendered, render):
    """The worker is a sidecar of its scheduler's pod: it starts first and stops last."""
    objects = rendered[render]
    worker, worker_pod = pagedserve_container(objects, "worker")
    scheduler, scheduler_pod = pagedserve_container(objects, "scheduler")
    assert worker_pod is scheduler_pod
    assert worker in worker_pod["initContainers"] and worker["restartPolicy"] == "Always"
    assert scheduler in scheduler_pod["containers"]
    listen = port_of(service_environment(objects, "worker")["PAGEDSERVE_LISTEN"])
    assert service_environment(objects, "scheduler")["PAGEDSERVE_WORKER"] == f"127.0.0.1:{listen}"


def container_ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


@pytest.mark.parametrize("render", RENDERS)
def test_probes_ask_each_service_where_it_listens(rendered, render):
    from services.gateway.auth import OPEN_PATHS

    objects = rendered[render]
    for service in ("scheduler", "worker"):  # the gRPC health service, on the port it listens on
        container, _ = pagedserve_container(objects, service)
        listen = port_of(service_environment(objects, service)["PAGEDSERVE_LISTEN"])
        assert container_ports(container) == {service: listen}
        grpc_probes = [container[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                       if "grpc" in container.get(p, {})]
        assert grpc_probes and set(grpc_probes) == {listen}, service
        assert "livenessProbe" in container, service
    gateway, _ = pagedserve_container(objects, "gateway")
    variables = service_environment(objects, "gateway")
    assert container_ports(gateway) == {"http": int(variables["PAGEDSERVE_PORT"]),
                                        "grpc": int(variables["PAGEDSERVE_GRPC_PORT"])}
    probes = {p: gateway[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/health"  # the one that says whether it can serve
    for probe in probes.values():  # a probe carries no API key
        assert probe["path"] in OPEN_PATHS and probe["port"] == "http"


def drain_timeout(objects: list[dict], service: str) -> float:
    """The service's --drain-timeout: its variable's, else the option's default."""
    value = service_environment(objects, service).get("PAGEDSERVE_DRAIN_TIMEOUT")
    (option,) = [option for option in options_by_service()[service] if option.name == "drain_timeout"]
    return float(value) if value else option.default


def pre_stop_seconds(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


# After their drain: the gateway's farewell to requests it fails (services/gateway/server.py), the
# scheduler's and the worker's servers closing (2 s and 5 s, services/*/server.py).
CLOSING_S = {"gateway": 2.0, "scheduler": 2.0 + 5.0}


@pytest.mark.parametrize("render", RENDERS)
def test_pods_have_time_to_drain(rendered, render):
    """SIGTERM starts each service's drain: the pod's grace period covers the pause before it, the
    drain and the closing after it, else the kubelet kills requests the drain would have finished."""
    from services.gateway.server import FAREWELL_S

    assert CLOSING_S["gateway"] == FAREWELL_S
    objects = rendered[render]
    for service in ("gateway", "scheduler"):
        container, pod = pagedserve_container(objects, service)
        needed = pre_stop_seconds(container) + drain_timeout(objects, service) + CLOSING_S[service]
        assert pod["terminationGracePeriodSeconds"] >= needed, service
    gateway, _ = pagedserve_container(objects, "gateway")
    assert pre_stop_seconds(gateway) > 0  # the Service's endpoints drop the pod before it stops listening


@pytest.mark.parametrize("render", RENDERS)
def test_no_service_links_reach_the_options(rendered, render):
    """Kubernetes would put PAGEDSERVE_GATEWAY_PORT=tcp://... and such in every pod's environment;
    a service named pagedserve would make it PAGEDSERVE_PORT, which the gateway reads as --port."""
    assert all(t["spec"]["enableServiceLinks"] is False for t in pod_templates(rendered[render]))


def test_the_built_in_model_is_made_where_the_gateway_reads_it(rendered):
    objects = rendered["cpu"]
    gateway, pod = pagedserve_container(objects, "gateway")
    (maker,) = pod["initContainers"]
    module, name = re.fullmatch(r"from ([\w.]+) import (\w+); \2\(\)", maker["command"][2]).groups()
    assert callable(getattr(importlib.import_module(module), name))
    assert maker["volumeMounts"] == gateway["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "PAGEDSERVE_CACHE=/models" in dockerfile  # where default_model_dir() puts it, in the worker too
    worker, _ = pagedserve_container(objects, "worker")
    assert {"name": "models", "mountPath": "/models"} in worker["volumeMounts"]


# --- the hardware ------------------------------------------------------------------------------------

def images(objects: list[dict]) -> set[str]:
    return {c["image"] for t in pod_templates(objects) for c in all_containers(t["spec"])
            if c["image"].startswith("pagedserve")}


def test_the_gpu_overlay_gives_each_worker_a_gpu(rendered):
    objects = rendered["gpu"]
    worker, pod = pagedserve_container(objects, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    (shm,) = [m for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert images(objects) == {"pagedserve:gpu"}  # one CUDA image for every service, as compose.gpu.yaml
    assert service_environment(objects, "worker").get("PAGEDSERVE_KV_CACHE_MEMORY_BYTES", "") == ""


def test_the_cpu_overlay_sizes_the_worker_for_its_cores(rendered):
    objects = rendered["cpu"]
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(objects)
    assert images(objects) == {"pagedserve:latest"}
    worker, _ = pagedserve_container(objects, "worker")
    (threads,) = [v for v in worker["env"] if v["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu" and worker["resources"]["limits"]["cpu"]
    memory = worker["resources"]["limits"]["memory"]
    assert memory.endswith("Gi")
    variables = service_environment(objects, "worker")
    kv_and_swap = int(variables["PAGEDSERVE_KV_CACHE_MEMORY_BYTES"]) + float(variables["PAGEDSERVE_SWAP_SPACE"]) * 2**30
    assert int(memory[:-2]) * 2**30 - kv_and_swap >= 2 * 2**30  # the built-in model and the runtime beside them


# --- Redis and the autoscaler -------------------------------------------------------------------------

@pytest.mark.parametrize("render", ("cpu+redis", "gpu+redis"))
def test_the_gateways_keep_their_keys_in_the_cluster_redis(rendered, render):
    objects = rendered[render]
    store = service_environment(objects, "gateway")["PAGEDSERVE_API_KEY_STORE"]
    (service,) = named(objects, "Service", "pagedserve-redis")
    assert re.fullmatch(rf"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/\d+", store)


def test_without_redis_the_gateway_reads_an_optional_secret(rendered):
    objects = rendered["cpu"]
    gateway, _ = pagedserve_container(objects, "gateway")
    (secret,) = [source["secretRef"] for source in gateway["envFrom"] if "secretRef" in source]
    assert secret["optional"] is True and not named(objects, "Secret")  # made by hand for an external Redis


def exported_metrics() -> set[str]:
    """The sample names a gateway's /metrics has before any request."""
    from services.gateway.metrics import GatewayMetrics

    text = GatewayMetrics().render({}, {}, "model").decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_the_autoscaler_reads_what_the_adapter_makes_of_the_gateways_metrics(rendered):
    adapter = yaml.safe_load((KUBERNETES / "prometheus-adapter.yaml").read_text())["rules"]["custom"]
    made = {}
    for rule in adapter:
        series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
        assert series.startswith("vllm:") and series in exported_metrics(), series
        assert re.fullmatch(rule["name"]["matches"], series)
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # a pods metric
        made[rule["name"]["as"]] = series
    (autoscaler,) = named(rendered["cpu"], "HorizontalPodAutoscaler")
    pods_metrics = [m["pods"]["metric"]["name"] for m in autoscaler["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metrics and set(pods_metrics) <= set(made)
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == "pagedserve-gateway"
    (gateways,) = named(rendered["cpu"], "Deployment", "pagedserve-gateway")
    assert "replicas" not in gateways["spec"]  # the autoscaler's to set: an apply must not reset it
    assert gateways["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == \
        service_environment(rendered["cpu"], "gateway")["PAGEDSERVE_PORT"]
