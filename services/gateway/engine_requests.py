"""A client's request as engine requests: one per prompt, each with an id of its own."""

from __future__ import annotations

import uuid

from shared.request import EngineRequest


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_requests(request_id: str, prompts: list[list[int]], unique: bool = True, images: list[tuple] | None = None,
                    **fields) -> list[EngineRequest]:
    """One engine request per prompt, each with ``fields`` (EngineRequest's) and its own ``images`` (one entry per
    prompt; None: none). Their ids are request_id-<8 random hex digits>-<i>: a client's X-Request-Id may repeat
    (a tracing header), engine ids must not; with ``unique`` false, request_id itself (one prompt: the gRPC API
    aborts by the client's id)."""
    images = images or [()] * len(prompts)
    if not unique:
        return [EngineRequest(request_id, prompt, images=own, **fields) for prompt, own in zip(prompts, images)]
    ids = f"{request_id}-{uuid.uuid4().hex[:8]}"
    return [EngineRequest(f"{ids}-{i}", prompt, images=own, **fields)
            for i, (prompt, own) in enumerate(zip(prompts, images))]
