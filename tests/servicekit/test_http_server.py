"""servicekit.http_server: uvicorn on the service's loop, its housekeeping tick once a second (not
ten times: every service runs one, and each tick wakes the process), stopped at once on request,
with the Date header still sent."""

from __future__ import annotations

import asyncio
import urllib.request

from servicekit import http_server
from servicekit.http_server import HttpServer


async def _app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_server_ticks_once_a_second_sends_a_date_and_stops_without_waiting_for_a_tick(monkeypatch):
    ticks = 0
    on_tick = http_server._Server.on_tick

    async def counting(self, counter):
        nonlocal ticks
        ticks += 1
        return await on_tick(self, counter)

    monkeypatch.setattr(http_server._Server, "on_tick", counting)
    server = HttpServer(_app, name="test")
    port = server.bind("127.0.0.1", 0)
    await server.start()
    await asyncio.sleep(1.5)
    assert 1 <= ticks <= 3  # uvicorn's own loop: 15
    reply = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/", timeout=5)
    assert reply.read() == b"ok"
    assert reply.headers["Date"].endswith(" GMT")

    monkeypatch.setattr(http_server, "TICK_S", 3600.0)  # a stop must not wait for the next tick
    await asyncio.sleep(1.1)  # the loop is now in a one-hour wait
    await asyncio.wait_for(server.stop(0.1), 3)  # else stop() waits 5 s for the task, then cancels it
