"""Waiting on a generation while watching for the client going away, and the server-sent-events
response that cancels its generation when the client leaves."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import StreamingResponse

from runtime.api import Job
from runtime.server.errors import ClientGone


async def unless_disconnected(request: Request, job: Job, awaitable):
    """Await `awaitable`, but cancel the job and raise ClientGone if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        job.cancel()
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            job.cancel()
            try:
                await task  # lets the job settle (it stops after the current target pass)
            except BaseException:
                pass


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """Server-sent events that always watch for the client going away (whatever the ASGI
    server's spec version) and then cancel the generation."""

    media_type = "text/event-stream"

    def __init__(self, content, on_disconnect):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self._send_all(send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            done, _ = await asyncio.wait({streaming, watch}, return_when=asyncio.FIRST_COMPLETED)
            if streaming not in done:
                self._on_disconnect()
                streaming.cancel()
            try:
                await streaming
            except (asyncio.CancelledError, OSError):
                pass
        finally:
            watch.cancel()
            if not streaming.done():
                streaming.cancel()

    async def _send_all(self, send) -> None:
        try:
            await self.stream_response(send)
        finally:
            await self.body_iterator.aclose()
