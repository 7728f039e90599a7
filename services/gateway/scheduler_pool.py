"""Several schedulers behind one gateway (data parallelism: each scheduler drives its own worker,
with its own KV cache), one SchedulerClient each; the gateway's requests are spread over them.

Routing rule, per request:
1. Only schedulers whose health the last poll (every HEALTH_POLL_S) found SERVING are chosen from;
   the others are tried last, least loaded first, in case they are back (before the first poll,
   that is every one).
2. Of those with at most BALANCE_SLACK (or a quarter) more requests in flight from this gateway than
   the least loaded one, a request goes to the one whose prefix caches hold the longest start of its
   prompt (each scheduler tells the gateway what they hold on its Session stream, opened once the poll
   finds it serving: prefix_routing.py); of equals, the least loaded, then the hash below.
3. When none of them holds any of it, it goes to the scheduler that its prompt's first AFFINITY_TOKENS
   tokens (and cache salt) hash to (rendezvous hashing: every gateway agrees, and a scheduler that
   leaves moves only its own share), so that prompts that start alike meet in one prefix cache even
   before it holds them; unless that one is above the slack of rule 2: then the least loaded.
4. A scheduler that cannot be reached when the request is submitted is skipped for the next one;
   a request that a scheduler has accepted stays there until that scheduler is lost: then the
   gateway resumes it (services/gateway/resumption.py), choosing again by these rules.
A scheduler serving another model (or another context length, vocabulary or block size) than the
first one the gateway learned is never used, and says so in the log; each is compared when the poll
first finds it serving, and again whenever it comes back.
"""

from __future__ import annotations

import array
import asyncio
import hashlib

from services.gateway.prefix_routing import prompt_keys
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.scheduler_session import SubmitStream
from shared.grpc_errors import ServiceUnavailable
from shared.lora import prefix_cache_extra
from shared.logging import setup_logging
from shared.proto import pagedserve_internal_pb2 as wire
from shared.request import EngineRequest

log = setup_logging("gateway")

HEALTH_POLL_S = 1.0
STATS_TIMEOUT_S = 2.0  # /metrics must answer well within a scrape's timeout (Prometheus: 10 s)
AFFINITY_TOKENS = 32
BALANCE_SLACK = 4


class SchedulerPool:
    def __init__(self, clients: list[SchedulerClient], route_by_prefix: bool = True):
        """``route_by_prefix``: rule 2 applies (--routing cached-prefix); else only rules 1, 3 and 4."""
        addresses = [client.address for client in clients]
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError(f"give one or more distinct scheduler addresses, got {addresses}")
        self.clients = clients
        self.address = ",".join(addresses)  # for messages
        # Until the first poll says, each is tried in turn (a single scheduler is never polled).
        self._serving = {client.address: len(clients) == 1 for client in self.clients}
        self._checked: set[str] = set()  # serve the reference model: compared once, when first seen serving
        self._excluded: dict[str, str] = {}  # address -> why it is never used (another model)
        self._reference: wire.EngineInfo | None = None  # the first scheduler's model: all must match it
        self._poller: asyncio.Task | None = None
        self.route_by_prefix = route_by_prefix

    @classmethod
    def connect(cls, addresses: list[str], connect_timeout_s: float = 2.0, idle_timeout_s: float = 120.0,
                route_by_prefix: bool = True) -> "SchedulerPool":
        return cls([SchedulerClient(a, connect_timeout_s=connect_timeout_s, idle_timeout_s=idle_timeout_s)
                    for a in addresses], route_by_prefix)

    def start(self) -> None:
        """Poll health in the background (a single scheduler needs no choosing)."""
        if len(self.clients) > 1 and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    # --- choosing ------------------------------------------------------------------------------------

    def candidates(self, request: EngineRequest) -> list[SchedulerClient]:
        """The schedulers to try for a request, best first (the rule above)."""
        if len(self.clients) == 1:
            return self.clients
        usable = [c for c in self.clients if c.address not in self._excluded]
        serving = [c for c in usable if self._serving[c.address]]
        resting = sorted((c for c in usable if not self._serving[c.address]), key=lambda c: c.num_in_flight)
        if not serving:
            return resting
        key = _affinity_key(request)
        by_hash = sorted(serving, key=lambda c: _score(c.address, key), reverse=True)
        least = min(c.num_in_flight for c in serving)
        within_slack = [c for c in by_hash if c.num_in_flight <= least + max(BALANCE_SLACK, least // 4)]
        preferred = self._holding_longest_prefix(request, within_slack)
        if preferred is None:
            preferred = by_hash[0] if by_hash[0] in within_slack else min(by_hash, key=lambda c: c.num_in_flight)
        rest = sorted((c for c in serving if c is not preferred), key=lambda c: c.num_in_flight)
        return [preferred, *rest, *resting]

    def _holding_longest_prefix(self, request: EngineRequest, clients: list[SchedulerClient]
                                ) -> SchedulerClient | None:
        """Rule 2: of the clients (in hash order, which breaks the last ties), the one holding the most of the
        prompt's first blocks, of equals the least loaded; None when none holds any."""
        if not self.route_by_prefix or self._reference is None or not self._reference.block_size:
            return None
        keys = prompt_keys(request, self._reference.block_size)
        if not keys:
            return None
        held = [client.cached_blocks(keys) for client in clients]
        best = max(range(len(clients)), key=lambda i: (held[i], -clients[i].num_in_flight))  # (the first of equals)
        return clients[best] if held[best] else None

    async def submit(self, request: EngineRequest, avoid: str | None = None) -> SubmitStream:
        """avoid: a scheduler to try last (the one a resumed request was just lost at: it may be hung
        without the health poll knowing yet)."""
        error: Exception | None = None
        for client in sorted(self.candidates(request), key=lambda c: c.address == avoid):  # (stable: the order stays)
            try:
                return await client.submit(request)
            except ServiceUnavailable as exc:  # not reachable: nothing was sent, so the next one may take it
                if len(self.clients) > 1:
                    self._serving[client.address] = False
                    log.warning("scheduler unreachable, trying the next", scheduler=client.address, error=str(exc))
                error = exc
        raise error or ServiceUnavailable(f"no scheduler serves the model: {self._excluded}")

    # --- asking all of them ----------------------------------------------------------------------------

    async def info(self) -> wire.EngineInfo:
        """The model, from the first scheduler that answers (it becomes the reference the others must match)."""
        error: Exception | None = None
        for client in sorted(self.clients, key=lambda c: not self._serving[c.address]):
            if client.address in self._excluded:
                continue
            try:
                info = await client.info()
            except ServiceUnavailable as exc:
                error = exc
                continue
            self._check_same_model(client.address, info)
            if client.address not in self._excluded:
                return info
        raise error or ServiceUnavailable(f"no scheduler serves the model: {self._excluded}")

    async def abort(self, request_id: str) -> bool:
        """Whether any scheduler had the request (ServiceUnavailable only when none answers)."""
        results = await asyncio.gather(*(c.abort(request_id) for c in self.clients), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(results):
            raise errors[0]
        return any(r is True for r in results)

    async def stats(self) -> dict[str, wire.EngineStats | None]:
        """Each scheduler's engine stats by address; None for one that did not answer within
        STATS_TIMEOUT_S (a scheduler whose step hangs on its worker answers only after it)."""
        results = await asyncio.gather(*(asyncio.wait_for(c.stats(), STATS_TIMEOUT_S) for c in self.clients),
                                       return_exceptions=True)
        return {c.address: None if isinstance(r, BaseException) else r for c, r in zip(self.clients, results)}

    def routable(self) -> dict[str, bool]:
        """By address: whether new requests may go there now (rule 1, and the same model)."""
        return {c.address: self._serving[c.address] and c.address not in self._excluded for c in self.clients}

    def prefix_blocks_known(self) -> dict[str, int]:
        """By address: how many cached blocks its Session stream says the scheduler's prefix caches hold."""
        return {c.address: c.num_cached_blocks for c in self.clients}

    async def healthy(self) -> bool:
        """Whether any scheduler serves (the gateway can answer requests)."""
        results = await asyncio.gather(*(c.healthy() for c in self.clients if c.address not in self._excluded),
                                       return_exceptions=True)
        return any(r is True for r in results)

    def abandon_requests(self, error: Exception) -> None:
        for client in self.clients:
            client.abandon_requests(error)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    # --- health ------------------------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(c) for c in self.clients if c.address not in self._excluded),
                                 return_exceptions=True)  # (each catches its own; nothing may end the poll)
            await asyncio.sleep(HEALTH_POLL_S)

    async def _poll_one(self, client: SchedulerClient) -> None:
        address = client.address
        try:
            serving = await client.healthy()
            if serving and (address not in self._checked or not self._serving[address]):
                # First seen serving, or back: (still) the model the others serve? A restarted
                # scheduler may have come back on another worker.
                self._check_same_model(address, await client.info())
                self._checked.add(address)
                serving = address not in self._excluded
            if serving and self.route_by_prefix:
                await client.open_session()  # (once per stream) to hear what its prefix caches hold
        except Exception as exc:  # unreachable, or not a scheduler at all (UNIMPLEMENTED)
            log.debug("scheduler health poll failed", scheduler=address, error=str(exc))
            serving = False
        if serving != self._serving[address]:
            log.info("scheduler serving" if serving else "scheduler not serving", scheduler=address)
        self._serving[address] = serving

    def _check_same_model(self, address: str, info: wire.EngineInfo) -> None:
        if self._reference is None:
            self._reference = info
            return
        ref = self._reference
        # (a pooling scheduler of the same directory serves another kind of request: not the same model; one of
        # another block size hashes prompts into other blocks: routing by cached prefix could never find them)
        mine = (info.model, info.max_model_len, info.vocab_size, info.protocol_version, info.pooler, info.block_size)
        theirs = (ref.model, ref.max_model_len, ref.vocab_size, ref.protocol_version, ref.pooler, ref.block_size)
        if mine != theirs:
            why = f"serves {mine}, the others {theirs}"
            if self._excluded.get(address) != why:
                log.error("scheduler serves another model: never used", scheduler=address, why=why)
            self._excluded[address] = why


def _affinity_key(request: EngineRequest) -> bytes:
    """What the scheduler's prefix cache keys blocks by: requests that could share blocks go to one scheduler."""
    head = array.array("q", request.prompt_token_ids[:AFFINITY_TOKENS]).tobytes()
    return head + prefix_cache_extra(request.cache_salt, request.lora)


def _score(address: str, key: bytes) -> bytes:
    return hashlib.blake2b(address.encode() + b"\0" + key, digest_size=8).digest()
