"""A streamed answer over HTTP: server-sent events, one per chunk of its reply, sent as they come."""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from services.gateway.http_errors import error_body
from shared.logging import setup_logging

log = setup_logging("gateway")


class EventStream(StreamingResponse):
    """A streamed reply as server-sent events, closed by `data: [DONE]` (chat, completions); an error after the headers
    went out becomes an error event. However the response ends (done, failed, client gone, or never
    started), the reply's engine requests are cancelled and its concurrency slot is freed.

    The chunks are framed and sent here rather than through a body iterator: this loop runs once
    per token per stream, so it keeps to one generator (the reply's) between the scheduler's
    output and the socket."""

    def __init__(self, reply):
        super().__init__((), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.reply = reply

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        events = self.reply.events()
        try:
            failed = False
            while not failed:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:  # the generation failed (a failed send is not: it propagates)
                    log.warning("stream failed", error=str(exc))
                    event, failed = self.reply.error_event(error_body(exc)[1]), True
                await send({"type": "http.response.body", "body": self.reply.frame(event), "more_body": True})
        finally:
            await events.aclose()  # a disconnect lands here too: the runs abort their requests at the scheduler
        await send({"type": "http.response.body", "body": self.reply.done_frame or b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.reply.aclose()
