"""What one HTTP client may send the gateway and hold open (the --http-* flags): each limit bounds what a
slow, huge or endless request costs the gateway, so that it keeps serving everyone else.

http_protocol.py enforces the timeouts, the header size and the connection cap as the bytes arrive;
body_limit.py refuses a body over its size before the app parses any of it.
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass

from shared.logging import setup_logging

log = setup_logging("gateway")

FILES_RESERVE = 256  # open files the gateway needs besides its client connections (gRPC, Redis, logs, libraries)


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 16 * 2 ** 20  # a larger body gets 413 (a prompt at a 1M-token context fits)
    max_header_bytes: int = 64 * 2 ** 10  # request line and headers; more gets 431
    header_timeout_s: float = 20.0  # from a request's first byte (a connection's opening) to its last header: 408
    body_timeout_s: float = 60.0  # from the last header to the body's last byte: 408
    max_connections: int = 4096  # a request on a connection beyond these gets 503

    def __post_init__(self):
        for flag, value in (("--http-max-body-size", self.max_body_bytes),
                            ("--http-max-header-size", self.max_header_bytes),
                            ("--http-max-connections", self.max_connections)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        for flag, value in (("--http-header-timeout", self.header_timeout_s),
                            ("--http-body-timeout", self.body_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpLimits":
        return cls(args.http_max_body_size, args.http_max_header_size, args.http_header_timeout,
                   args.http_body_timeout, args.http_max_connections)


def make_room_for_connections(limits: HttpLimits) -> None:
    """Raise the open-files limit (up to the hard one) so that the connection cap, not the operating system,
    is what refuses connections: past the limit, accept() fails and new clients wait in the listen backlog."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limits.max_connections + FILES_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < wanted:
            log.warning("the open-files limit is below what --http-max-connections needs: connections beyond "
                        "about this many wait in the listen backlog", open_files=raised,
                        connections=raised - FILES_RESERVE)
