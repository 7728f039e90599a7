"""compose.yaml's services, started as local processes configured only by its environment variables."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.services_harness import free_port, http_get, wait_until_ready

REPO = Path(__file__).resolve().parents[2]


def interpolate(value: str, env: dict[str, str]) -> str:
    """docker compose's ${VAR:-default}, from the given environment."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), str(value))


def compose_services(user_env: dict[str, str]) -> dict[str, dict]:
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    return {name: {"command": svc["command"], "env": {k: interpolate(v, user_env) for k, v in svc["environment"].items()},
                   "healthcheck": svc["healthcheck"]["test"]}
            for name, svc in spec["services"].items() if svc.get("image") == "pagedserve:latest"}  # not redis


def to_loopback(services: dict[str, dict], ports: dict[str, int]) -> None:
    """Container names and 0.0.0.0 become loopback addresses on free ports; nothing else changes."""
    for svc in services.values():
        env = svc["env"]
        for key, value in env.items():
            for name, port in ports.items():
                value = re.sub(rf"\b{name}:\d+", f"127.0.0.1:{port}", value)
            env[key] = value.replace("0.0.0.0:50061", f"127.0.0.1:{ports['worker']}") \
                .replace("0.0.0.0:50051", f"127.0.0.1:{ports['scheduler']}")
        if env.get("PAGEDSERVE_HOST") == "0.0.0.0":
            env["PAGEDSERVE_HOST"] = "127.0.0.1"


def test_services_run_from_compose_environment(llama_dir, tmp_path):
    user_env = {"PAGEDSERVE_MODEL": str(llama_dir), "PAGEDSERVE_KV_CACHE_MEMORY_BYTES": str(8 << 20),
                "PAGEDSERVE_SERVED_MODEL_NAME": "tiny"}
    services = compose_services(user_env)
    ports = {"worker": free_port(), "scheduler": free_port()}
    to_loopback(services, ports)
    http_port, grpc_port = free_port(), free_port()
    services["gateway"]["env"].update(PAGEDSERVE_PORT=str(http_port), PAGEDSERVE_GRPC_PORT=str(grpc_port))
    procs = {}
    try:
        for name in ("worker", "scheduler", "gateway"):
            env = {**os.environ, **services[name]["env"]}
            log = open(tmp_path / f"{name}.log", "wb")
            procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve", *services[name]["command"]],
                                           cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{http_port}"
        wait_until_ready(lambda: http_get(f"{base}/health", 5)[0] == 200, procs, tmp_path, "the services to become healthy")
        request = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                          "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=30) as reply:
            body = json.loads(reply.read())
        assert body["usage"]["completion_tokens"] >= 1 and body["model"] == "tiny"
        # The containers' health checks, run as compose would run them (with loopback addresses).
        checks = {"worker": ["grpc", f"127.0.0.1:{ports['worker']}"],
                  "scheduler": ["grpc", f"127.0.0.1:{ports['scheduler']}"],
                  "gateway": ["http", f"{base}/health"]}
        for name, check in checks.items():
            assert services[name]["healthcheck"][2:4] == ["-m", "shared.healthcheck"]
            done = subprocess.run([sys.executable, "-m", "shared.healthcheck", *check], cwd=REPO)
            assert done.returncode == 0, f"{name} health check failed"
    finally:
        for name in ("gateway", "scheduler", "worker"):
            if name in procs and procs[name].poll() is None:
                procs[name].terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def test_only_the_gateway_is_published_and_on_loopback_unless_told():
    """The scheduler, the worker and Redis have no authentication: they are on the internal network
    alone; the gateway's ports are this host's loopback unless PAGEDSERVE_PUBLISH_ADDRESS opens them."""
    spec = load("compose.yaml")
    assert spec["networks"]["backend"]["internal"] is True
    for name, svc in spec["services"].items():
        if name == "gateway":
            assert svc["networks"] == ["backend", "frontend"]
            assert [interpolate(port, {}) for port in svc["ports"]] == ["127.0.0.1:8000:8000", "127.0.0.1:50050:50050"]
            assert interpolate(svc["ports"][0], {"PAGEDSERVE_PUBLISH_ADDRESS": "0.0.0.0"}) == "0.0.0.0:8000:8000"
        else:
            assert svc["networks"] == ["backend"] and "ports" not in svc, name


def test_the_gpu_and_model_overrides():
    gpu = load("compose.gpu.yaml")["services"]
    worker = gpu["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    declared = set(re.findall(r"^ARG (\w+)", (REPO / "Dockerfile").read_text(), re.MULTILINE))
    for name in ("worker", "scheduler", "gateway"):  # one CUDA build serves all three
        assert gpu[name]["image"] == "pagedserve:gpu" and set(gpu[name]["build"]["args"]) <= declared, name
    assert interpolate(worker["environment"]["PAGEDSERVE_KV_CACHE_MEMORY_BYTES"], {}) == ""  # the GPU's share
    model = load("compose.model.yaml")["services"]
    for name in ("worker", "gateway"):  # the weights, and the tokenizer from the path the worker reports
        (volume,) = model[name]["volumes"]
        host, inside, mode = re.sub(r"\$\{PAGEDSERVE_MODEL(:\?[^}]*)?\}", "/srv/m", volume).split(":")
        assert (host, inside, mode) == ("/srv/m", "/srv/m", "ro"), name


def test_the_disaggregation_override(monkeypatch):
    """A prefill worker like the worker service, and the scheduler told of both (and of no --worker)."""
    from services.scheduler.server import build_parser
    from shared.option_env import apply_env_defaults

    spec = load("compose.disaggregated.yaml")["services"]
    assert spec["prefill-worker"]["extends"] == {"file": "compose.yaml", "service": "worker"}
    env = {key: interpolate(value, {}) for key, value in spec["scheduler"]["environment"].items()}
    assert env == {"PAGEDSERVE_WORKER": "", "PAGEDSERVE_PREFILL_WORKER": "prefill-worker:50061",
                   "PAGEDSERVE_DECODE_WORKER": "worker:50061"}
    with monkeypatch.context() as patch:
        for key, value in {**env, "PAGEDSERVE_DECODE_WORKER": "d1:50061,d2:50061"}.items():
            patch.setenv(key, value)
        parser = build_parser()
        apply_env_defaults(parser)
        args = parser.parse_args([])
    assert (args.worker, args.prefill_worker, args.decode_worker) == (None, ["prefill-worker:50061"],
                                                                      ["d1:50061", "d2:50061"])


# Variables compose itself reads, not the services.
COMPOSE_ONLY = {"PAGEDSERVE_PUBLISH_ADDRESS": "the host address the gateway's ports are published on",
                "PAGEDSERVE_TORCH_INDEX_URL": "where the CUDA image's torch comes from (a build argument)"}
COMPOSE_FILES = ("compose.yaml", "compose.gpu.yaml", "compose.model.yaml", "compose.disaggregated.yaml")


def options_by_service() -> dict:
    from pagedserve.serve_flags import service_options

    return service_options()


def test_every_variable_compose_names_is_an_option_of_its_service():
    """A variable no option has would be ignored without a word (a typo, or a flag renamed since)."""
    options = options_by_service()
    every = {option.env for service in options.values() for option in service} | set(COMPOSE_ONLY)
    for file in COMPOSE_FILES:
        for name, svc in load(file)["services"].items():
            known = {option.env for option in options.get(name, ())}
            for key, value in (svc.get("environment") or {}).items():
                assert key in known, f"{file}: the {name} has no option for {key}"
                assert set(re.findall(r"\$\{(PAGEDSERVE_\w+)", str(value))) <= {key}, f"{file}: {key} reads another"
        unknown = set(re.findall(r"\$\{(PAGEDSERVE_\w+)", (REPO / file).read_text())) - every
        assert unknown == set(), f"{file} names variables no option has"


def test_the_worker_and_the_scheduler_read_the_same_limits():
    """The worker sizes its memory for the largest step the scheduler's limits allow: compose gives both
    every limit, alike."""
    from shared.config import EngineConfig
    from shared.options import read_by

    spec = load("compose.yaml")["services"]
    limits = {option.env for option in read_by(EngineConfig, "scheduler")}
    worker, scheduler = ({key: value for key, value in spec[name]["environment"].items() if key in limits}
                         for name in ("worker", "scheduler"))
    assert set(worker) == limits and worker == scheduler


def test_compose_defaults_are_values_the_services_take(monkeypatch):
    from services.gateway.server import build_parser as gateway
    from services.scheduler.server import build_parser as scheduler
    from services.worker.server import build_parser as worker
    from shared.option_env import apply_env_defaults

    gpu = {key: interpolate(value, {}) for key, value in load("compose.gpu.yaml")["services"]["worker"]
           ["environment"].items()}
    parsers = {"worker": worker, "scheduler": scheduler, "gateway": gateway}
    for name, svc in compose_services({}).items():
        for env in (svc["env"], {**svc["env"], **gpu} if name == "worker" else svc["env"]):
            with monkeypatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                parser = parsers[name]()
                apply_env_defaults(parser)  # a value it cannot take ends the program
                parser.parse_args([])


def excluded(path: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a folder above it decides."""
    def matches(pattern: str, candidate: str) -> bool:
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.fullmatch(regex, candidate) is not None

    parts, verdict = path.split("/"), False
    for negated, pattern in rules:
        if any(matches(pattern, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            verdict = not negated
    return verdict


def test_the_build_context_is_what_the_image_copies():
    rules = [(line.startswith("!"), line.lstrip("!").rstrip("/"))
             for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    copied = [word for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for word in line.split()[1:-1]]
    assert copied and not [path for path in copied if excluded(path, rules)]
    for path in ("pagedserve/cli.py", "services/worker/attention/csrc/cpu_attention.cpp", "protos/x.proto"):
        assert not excluded(path, rules), path
    for path in (".venv/lib/torch/x.so", ".git/HEAD", "tests/test_x.py", "shared/__pycache__/x.pyc",
                 "benchmarks/results/a.json"):
        assert excluded(path, rules), path


@pytest.mark.skipif(subprocess.run(["which", "docker-compose"], capture_output=True).returncode != 0,
                    reason="docker-compose is not installed")
def test_compose_files_are_valid_and_merge():
    def config(*files: str, **env: str) -> dict:
        done = subprocess.run(["docker-compose", *(arg for f in files for arg in ("-f", str(REPO / f))), "config"],
                              capture_output=True, text=True, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr
        return yaml.safe_load(done.stdout)["services"]

    config("compose.yaml")
    merged = config("compose.yaml", "compose.gpu.yaml", "compose.model.yaml", PAGEDSERVE_MODEL="/srv/m")
    for name in ("worker", "gateway"):
        assert sorted(merged[name]["volumes"]) == ["/srv/m:/srv/m:ro", "models:/models:rw"], name
    assert merged["worker"]["environment"]["PAGEDSERVE_MODEL"] == "/srv/m"
    assert merged["worker"]["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")
    assert merged["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
