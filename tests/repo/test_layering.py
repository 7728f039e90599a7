"""The layers point one way: pagedserve/ (the public front: LLM, the CLI, the launcher) may import the
services and shared/; a service imports only shared/ and its own package; shared/ imports neither. And
shared/ holds what the services share: a module only one service uses lives in that service's package.

Read from the source (every import, those inside functions too), nothing imported: well under a second."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("services.gateway", "services.scheduler", "services.worker")
# Modules of shared/ that fewer than two services import, and why they are shared all the same.
SHARED_WITH_THE_FRONT = {
    "shared.healthcheck": "every service's container runs it as its health check (compose.yaml)",
    "shared.outputs": "the public API's results: the scheduler's engine makes them, the front's LLM returns them",
    "shared.version": "the front's __version__ and the gateway's GET /version",
}


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the three layers, by dotted name."""
    found = {}
    for top in ("pagedserve", "services", "shared"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def imports_of(module: str) -> frozenset[str]:
    """The project modules this module imports (`from a import b` counts a.b where b is a module)."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            named.add(base)
            named.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(name for name in named if name in modules())


def layer(module: str) -> str:
    """"pagedserve", "shared", or the service: "services.worker"."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else parts[0]


def crossings(allowed) -> list[str]:
    return sorted(f"{module} imports {target}" for module in modules() for target in imports_of(module)
                  if not allowed(layer(module), layer(target)))


def test_shared_imports_neither_a_service_nor_the_front():
    assert crossings(lambda source, target: source != "shared" or target == "shared") == []


def test_a_service_imports_only_shared_and_its_own_package():
    def allowed(source: str, target: str) -> bool:
        return not source.startswith("services") or target in (source, "shared", "services")

    assert crossings(allowed) == []


def test_shared_holds_what_services_share():
    """A module of shared/ that only one service uses belongs in that service's package (shared/ had grown
    the worker's model configuration). The generated gRPC code is shared as a whole."""
    users: dict[str, set[str]] = {module: set() for module in modules() if layer(module) == "shared"}
    for service in SERVICES:
        for module in reached_from([m for m in modules() if layer(m) == service]):
            if module in users:
                users[module].add(service)
    alone = {module: sorted(who) for module, who in users.items() if len(who) < 2
             and module not in SHARED_WITH_THE_FRONT and module.split(".")[:2] not in (["shared"], ["shared", "proto"])}
    assert alone == {}, "move each into the service that uses it (or say here why it is shared)"


def reached_from(starts: list[str]) -> set[str]:
    """Every module the starts import, directly or through others."""
    seen, todo = set(), list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imports_of(module))
    return seen
