"""Container health checks: `python -m shared.healthcheck grpc HOST:PORT` or `... http URL`; exit 0 if healthy."""

from __future__ import annotations

import sys
import urllib.request


def grpc_healthy(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.grpc_channels import RECONNECT_OPTIONS

    with grpc.insecure_channel(address, options=RECONNECT_OPTIONS) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http"):
        print("usage: python -m shared.healthcheck grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    healthy = grpc_healthy(argv[1]) if argv[0] == "grpc" else http_healthy(argv[1])
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
