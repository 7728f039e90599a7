"""Every gRPC channel the project opens takes its options from shared/grpc_channels.py: one opened with
gRPC's defaults backs off for up to two minutes while its peer is away, and a worker or scheduler that came
back would sit unused that long. Read from the source, nothing imported."""

from __future__ import annotations

import ast

from shared.grpc_channels import RECONNECT_OPTIONS, channel_options
from tests.repo.test_layering import modules

CHANNEL_MAKERS = {"insecure_channel", "secure_channel"}


def channel_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in CHANNEL_MAKERS]


def imports_channel_options(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "shared.grpc_channels" for node in ast.walk(tree))


def test_every_channel_is_opened_with_the_shared_options():
    found, wrong = 0, []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for call in channel_calls(tree):
            found += 1
            if not any(k.arg == "options" for k in call.keywords) or not imports_channel_options(tree):
                wrong.append(f"{name}:{call.lineno}")
    assert found >= 5, "the check no longer finds the channels it is about"
    assert not wrong, f"channels opened without shared/grpc_channels.py's options: {wrong}"


def test_a_peer_is_tried_again_at_least_once_a_second():
    options = dict(channel_options(1 << 20))
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000
    assert options.items() >= dict(RECONNECT_OPTIONS).items()
    assert "grpc.min_reconnect_backoff_ms" not in options  # (gRPC's shortest connection attempt: left at 20 s)
