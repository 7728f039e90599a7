"""A gRPC request id reused right after its stream was cancelled: the old call's abort goes first."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from services.gateway.billing import Admission
from services.gateway.call_ids import CallIds
from services.gateway.deltas import SeqDelta
from services.gateway.generator import Generator
from services.gateway.grpc_api import GenerationServicer
from shared.generation_defaults import GenerationDefaults
from shared.grpc_errors import error_for_code
from shared.proto import pagedserve_api_pb2 as api


def test_a_reused_id_waits_for_the_call_before_it_to_end():
    async def main():
        ids, order = CallIds(grace_s=5), []
        first_in = asyncio.Event()
        release = asyncio.Event()

        async def first():
            async with ids.claim("a"):
                first_in.set()
                await release.wait()
                order.append("first ends")

        async def second():
            async with ids.claim("a"):
                order.append("second starts")

        one = asyncio.create_task(first())
        await first_in.wait()
        two = asyncio.create_task(second())
        async with ids.claim("b"):  # another id does not wait
            order.append("other id")
        for _ in range(20):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(one, two)
        assert order == ["other id", "first ends", "second starts"]
        assert len(ids) == 0  # nothing kept once the calls ended

    asyncio.run(main())


def test_a_true_duplicate_goes_ahead_after_the_grace():
    async def main():
        ids = CallIds(grace_s=0.05)
        async with ids.claim("a"):
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with ids.claim("a"):  # the first never ends: the scheduler will refuse this one
                waited = loop.time() - started
            assert 0.04 <= waited < 2
            async with ids.claim("a"):  # the duplicate's entry replaced the first's, and it has ended
                pass
        assert len(ids) == 0

    asyncio.run(main())


def test_a_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace_s"):
        CallIds(grace_s=-1)


# --- the servicer: a cancelled call whose send was in progress ------------------------------------------


class Stream:
    """A run that has tokens to give until it is cancelled; it records what the scheduler would see."""

    def __init__(self, request_id: str, log: list[str]):
        self.request_id, self._log = request_id, log
        self.prompt, self.prompt_logprobs, self.completion_tokens = [1], None, 0
        self._cancelled = False

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._log.append(f"abort {self.request_id}")

    def abort(self) -> None:  # an Abort RPC: the stream would go on to the sequences' "abort" ends
        self._log.append(f"abort rpc {self.request_id}")

    async def __aiter__(self):
        index = 0
        while True:
            index += 1
            yield SeqDelta(0, [index], "x")


class Gen:
    max_model_len = 512  # (the huge-prompt bound reads it)
    tracing = None  # untraced (--otlp-traces-endpoint not given)
    tokenized = Generator.tokenized  # the real way off the event loop
    generation_defaults = GenerationDefaults()  # the model's: none

    def __init__(self):
        self.log: list[str] = []

    def resolve(self, name: str) -> None:
        return None  # the model itself: no adapter

    def encode(self, text: str) -> list[int]:
        return [1]

    async def model(self):
        return self

    def admitted(self, api_key=None):
        return contextlib.nullcontext(Admission())  # async-capable

    async def start(self, model, requests, on_submit=None, admission=None):
        (request,) = requests
        self.log.append(f"submit {request.request_id}")
        stream = Stream(request.request_id, self.log)
        if on_submit is not None:
            on_submit(stream)
        return [stream]


class SlowContext:
    """A call's context whose first write never completes (a send in progress when the client cancels)."""

    def __init__(self):
        self.writing = asyncio.Event()

    async def write(self, message) -> None:
        self.writing.set()
        await asyncio.Event().wait()

    async def abort(self, code, details):
        raise AssertionError(f"unexpected abort: {code} {details}")


def test_a_duplicate_the_scheduler_refuses_is_already_exists():
    class Duplicate(Gen):
        async def start(self, *args, **kwargs):  # what the session hands back for the scheduler's refusal
            raise error_for_code(grpc.StatusCode.ALREADY_EXISTS, "request id 'r' is already in use")

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    with pytest.raises(Aborted) as refused:
        asyncio.run(GenerationServicer(Duplicate()).Generate(api.GenerateRequest(request_id="r", text="hi"),
                                                             Context()))
    assert refused.value.args == (grpc.StatusCode.ALREADY_EXISTS, "request id 'r' is already in use")


class Aborted(Exception):
    pass


def test_a_cancelled_call_aborts_before_the_next_call_with_its_id_submits():
    async def main():
        gen = Gen()
        servicer = GenerationServicer(gen, CallIds(grace_s=5))
        request = api.GenerateRequest(request_id="r", text="hi")
        old_context = SlowContext()
        old = asyncio.create_task(servicer.Generate(request, old_context))
        await old_context.writing.wait()
        # gRPC starts the new call before it tells the old one that its client cancelled.
        new_context = SlowContext()
        new = asyncio.create_task(servicer.Generate(request, new_context))
        for _ in range(20):
            await asyncio.sleep(0)
        old.cancel()
        await new_context.writing.wait()
        assert gen.log == ["submit r", "abort r", "submit r"]
        new.cancel()
        await asyncio.gather(old, new, return_exceptions=True)
        assert gen.log[-1] == "abort r" and len(servicer.call_ids) == 0

    asyncio.run(main())


def test_an_abort_of_a_call_open_here_goes_through_the_call_even_before_it_submits():
    class Tokenizing(Gen):
        def __init__(self):
            super().__init__()
            self.release = asyncio.Event()
            self.client = self  # the scheduler's Abort RPC: must not be needed

        async def start(self, *args, **kwargs):
            await self.release.wait()  # still tokenizing when the Abort comes
            return await super().start(*args, **kwargs)

        async def abort(self, request_id):
            self.log.append(f"scheduler abort {request_id}")
            return False

    async def main():
        gen = Tokenizing()
        servicer = GenerationServicer(gen, CallIds())
        context = SlowContext()
        call = asyncio.create_task(servicer.Generate(api.GenerateRequest(request_id="r", text="hi"), context))
        for _ in range(20):
            await asyncio.sleep(0)
        assert (await servicer.Abort(api.AbortRequest(request_id="r"), None)).found
        assert gen.log == []  # not submitted yet: the abort waits for the submission
        gen.release.set()
        await context.writing.wait()
        assert gen.log == ["submit r", "abort rpc r"]
        assert (await servicer.Abort(api.AbortRequest(request_id="r"), None)).found  # again: nothing more sent
        assert gen.log == ["submit r", "abort rpc r"]
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        # The call has ended: an Abort naming it now asks the scheduler (the request may be at another gateway).
        assert not (await servicer.Abort(api.AbortRequest(request_id="r"), None)).found
        assert gen.log[-1] == "scheduler abort r" and len(servicer.call_ids) == 0

    asyncio.run(main())


def test_an_abort_that_overtakes_its_generate_waits_for_the_call_to_open():
    async def main():
        ids = CallIds(arrival_s=5)
        aborted = []

        class Run:
            def abort(self):
                aborted.append("r")

        waiting = asyncio.create_task(ids.abort_arriving("r"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()
        async with ids.claim("r") as call:
            assert await waiting is True and call.aborted
            call.attach(Run())  # submitted after the Abort came: aborted at once
        assert aborted == ["r"]
        quick = CallIds(arrival_s=0.05)
        assert await quick.abort_arriving("nobody") is False  # no such call: a short wait, then not found
        assert not quick._arrivals and len(quick) == 0

    asyncio.run(main())


def test_negative_waits_are_refused():
    with pytest.raises(ValueError, match="arrival_s"):
        CallIds(arrival_s=-1)


def test_an_abort_naming_a_call_that_just_ended_does_not_abort_the_next_call_with_its_id():
    async def main():
        ids = CallIds(arrival_s=5)
        async with ids.claim("r"):
            pass  # the first call ends
        stale = asyncio.create_task(ids.abort_arriving("r"))  # the client's late Abort of the first call
        await asyncio.sleep(0)  # it arrives first (its scheduler knew nothing of "r" any more)
        async with ids.claim("r") as reuse:
            assert await stale is False and not reuse.aborted
        assert not ids._arrivals

    asyncio.run(main())


def test_an_abort_reaches_a_call_still_waiting_for_its_predecessor_and_a_duplicate_alike():
    async def main():
        ids, release = CallIds(grace_s=5), asyncio.Event()
        entered = asyncio.Event()

        async def first():
            async with ids.claim("r") as call:
                entered.set()
                await release.wait()
                return call

        one = asyncio.create_task(first())
        await entered.wait()
        second_call = []

        async def second():
            async with ids.claim("r") as call:  # waits for the first to end
                second_call.append(call)

        two = asyncio.create_task(second())
        for _ in range(20):
            await asyncio.sleep(0)
        assert ids.abort("r")  # both: the one running, and the one waiting to reuse the id
        release.set()
        first_call = await one
        await two
        assert first_call.aborted and second_call[0].aborted and len(ids) == 0

    asyncio.run(main())


def test_aborts_waiting_for_a_call_leave_nothing_behind_when_cancelled_or_many():
    async def main():
        ids = CallIds(arrival_s=5)
        cancelled = asyncio.create_task(ids.abort_arriving("x"))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert not ids._arrivals  # a cancelled Abort (client deadline) leaves no waiter behind
        quick = CallIds(arrival_s=0.05)
        early = asyncio.create_task(quick.abort_arriving("y"))
        await asyncio.sleep(0.02)
        late = asyncio.create_task(quick.abort_arriving("y"))  # a second Abort, its window ends later
        assert await early is False
        async with quick.claim("y") as call:
            assert await late is True and call.aborted

    asyncio.run(main())
