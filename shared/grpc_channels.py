"""The options of every gRPC channel and server between pagedserve's own services, declared once."""

from __future__ import annotations

# A peer that is not up yet (a worker still loading its weights, a scheduler restarting) refuses the
# connection; it is tried again about once a second (gRPC's jitter: at most 1.2 s apart). gRPC's default backs
# off for up to two minutes: a worker that took a minute to load was used many seconds after it said SERVING,
# and a restarted scheduler likewise. (Not grpc.min_reconnect_backoff_ms: gRPC takes it as the shortest time
# a connection attempt may take, and with a short one a peer slow to answer, far away or on a loaded host,
# would never be reached.)
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000))

# The largest message between the gateway, the scheduler and the worker: a step's plan carries its new
# requests' image pixels (float32: eight 896 x 896 images are 77 MB).
STEP_MESSAGE_BYTES = 256 << 20


def message_limits(max_bytes: int) -> list[tuple[str, int]]:
    """Both directions' message limit: a step's plan or result, a KV block stream's message."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """A channel to another pagedserve service."""
    return [*message_limits(max_message_bytes), *RECONNECT_OPTIONS]


SERVER_OPTIONS = message_limits(STEP_MESSAGE_BYTES)  # the scheduler's and the worker's gRPC servers
