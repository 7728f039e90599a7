"""The version of the internal wire format (protos/pagedserve_internal.proto).

Gateway, scheduler and workers must come from the same release: a peer that reads a field in its
old place gets an empty value, not an error (the step outputs of version 1 are reserved numbers
in version 2). So each side reports this number in its info reply, and the side that asks refuses
a peer that reports another.
"""

from __future__ import annotations

from shared.grpc_errors import ServiceUnavailable

# 1: the first format (unversioned: it reads as 0); 2: plans, results and session events as columns;
# 3: a session may end one sequence of a request by a stop string, and requests carry a cache salt;
# 4: speculative decoding (draft tokens in plans and results, WorkerInfo's draft count and tensor-parallel rank);
# 5: a request may be submitted again with its sequences' outputs so far (resumed after a lost scheduler);
# 6: sampling parameters carry allowed_token_ids;
# 7: a sequence's last output says how many of its tokens the prefix cache held;
# 8: requests and new sequences may name a LoRA adapter, and WorkerInfo says how many adapters a step runs;
# 9: embedding requests (pooling parameters in, an embedding out) and the pooler in WorkerInfo and EngineInfo.
# 10: classifiers: a pooler's labels and activation, and a pooling request's task and use_activation.
# 11: WorkerInfo's kv_window; block tables may hold 0 for blocks freed behind it (never read).
# 12: EngineStats carries histograms (vLLM's per-request times, tokens per step) and text labels (LoRA adapters).
# 13: EngineRequest carries a priority and its arrival time.
# 14: EngineInfo says whether the scheduler orders requests by priority.
# 15: skipped (two changes were under way at once).
# 16: engine requests and new sequences carry their W3C trace context.
# 17: WorkerInfo says how many of its host blocks are the prefix cache's offload tier, and a step's result
#     which device blocks a swap-in failed to fill; SessionEvents carry the prefix caches' routing keys.
# 18: prefill/decode disaggregation: plans carry pulls of another worker's blocks, and workers serve ReadBlocks.
# 19: engine requests and new sequences carry images (shared/multimodal.py); WorkerInfo and EngineInfo say the
#     image token.
# 20: WorkerInfo says whether the model's images attend both ways (Gemma 3: a step computes an image whole).
INTERNAL_PROTOCOL_VERSION = 20


class IncompatiblePeer(ServiceUnavailable):
    """A peer from another release: nothing can be served through it."""


def check_peer_version(peer: str, address: str, version: int) -> None:
    if version != INTERNAL_PROTOCOL_VERSION:
        raise IncompatiblePeer(f"the {peer} at {address} speaks internal protocol version {version or 1}, this "
                               f"one version {INTERNAL_PROTOCOL_VERSION}: run the same pagedserve release everywhere")
