"""An ASGI app served by uvicorn on the service's own event loop, beside its gRPC server.

Used for the gateway's HTTP API and for every service's metrics port. On the same loop, a request
handler reads the service's state without locks (a metrics scrape sees a consistent snapshot), and
an HTTP call goes through the same coroutines as a gRPC one.

The socket is bound in :meth:`HttpServer.bind`, before serving starts, so a taken port fails the
service's start at once and port 0 reports the port it got. Signals stay the service's:
uvicorn's own handlers would replace ``servicekit.serving.wait_for_signal``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator

import uvicorn

from servicekit.tls import TlsFiles

log = logging.getLogger(__name__)


TICK_S = 1.0  # uvicorn's housekeeping period (its own: 0.1 s)


class _Server(uvicorn.Server):
    """uvicorn's server, with its housekeeping tick once a second instead of ten times: every
    service runs one (its metrics port at least), and each tick wakes the process — on a worker,
    beside its forward pass; an idle gateway spent ~5 ms of CPU a second. A second is the Date
    header's resolution anyway, and :meth:`exit` ends the loop at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # SIGTERM drains the whole service (servicekit.serving), not just this server

    def exit(self) -> None:
        self.should_exit = True
        self._exit.set()

    async def main_loop(self) -> None:
        counter = 0  # uvicorn's on_tick refreshes the Date header when counter % 10 == 0: every tick here
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            try:
                await asyncio.wait_for(self._exit.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass


class HttpServer:
    """``app`` on ``host:port`` (0: any free port). Lifecycle: bind → start → stop, once."""

    def __init__(self, app, *, name: str, tls: TlsFiles | None = None) -> None:
        self._app = app
        self._name = name
        self._tls = tls if tls is not None and tls.enabled else None  # HTTPS, client certificates with a CA
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    def bind(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the port. Raises OSError when it is taken."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart while old sockets linger
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        return self.port

    async def start(self) -> None:
        """Serve on the bound socket; returns once uvicorn accepts connections."""
        assert self._sock is not None, "bind first"
        tls = {}
        if self._tls is not None:  # read once at start (gRPC re-reads at each handshake; docs/operations.md "Security")
            tls = dict(ssl_certfile=self._tls.cert_file, ssl_keyfile=self._tls.key_file)
            if self._tls.ca_file:
                tls.update(ssl_ca_certs=self._tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self._app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, **tls)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"http-{self._name}")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it did not start
                raise OSError(f"{self._name} HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting, give open responses ``grace_s`` to end, then cancel them."""
        if self._server is None or self._task is None:
            if self._sock is not None:
                self._sock.close()
            return
        self._server.config.timeout_graceful_shutdown = max(0.1, grace_s)
        self._server.exit()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=grace_s + 5)
        except asyncio.TimeoutError:
            log.warning("%s HTTP server did not stop; cancelling it", self._name)
            self._task.cancel()
