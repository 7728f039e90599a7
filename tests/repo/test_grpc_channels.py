"""Every gRPC channel the project opens takes its reconnect options from shared/grpc_channels.py: one opened
with gRPC's defaults backs off for up to two minutes while its peer is away, and a worker or scheduler that
came back would sit unused that long. The channels are found in the source (ast), not by running them."""

from __future__ import annotations

import ast

from shared.grpc_channels import channel_options
from tests.repo.test_layering import modules

CHANNEL_MAKERS = {"insecure_channel", "secure_channel"}
SHARED_OPTIONS = {"RECONNECT_OPTIONS", "channel_options"}  # what a channel's options must be made from


def channel_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in CHANNEL_MAKERS]


def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def shared_option_names(tree: ast.Module) -> set[str]:
    """SHARED_OPTIONS, and the module's own constants made from them."""
    made = {target.id for node in tree.body if isinstance(node, ast.Assign) and names_in(node.value) & SHARED_OPTIONS
            for target in node.targets if isinstance(target, ast.Name)}
    return SHARED_OPTIONS | made


def has_shared_options(call: ast.Call, allowed: set[str]) -> bool:
    return any(k.arg == "options" and names_in(k.value) & allowed for k in call.keywords)


def test_every_channel_is_opened_with_the_shared_reconnect_options():
    found, wrong = 0, []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        allowed = shared_option_names(tree)
        for call in channel_calls(tree):
            found += 1
            if not has_shared_options(call, allowed):
                wrong.append(f"{name}:{call.lineno}")
    assert found >= 5, "the check no longer finds the channels it is about"
    assert not wrong, f"channels opened without shared/grpc_channels.py's reconnect options: {wrong}"


def test_a_refused_peer_is_tried_again_about_once_a_second():
    options = dict(channel_options(1 << 20))
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"] <= 1000
    assert "grpc.min_reconnect_backoff_ms" not in options  # (gRPC's shortest connection attempt: left at 20 s)
