"""Serving the admin API from the controller's event loop with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import structlog
import uvicorn
from fastapi import FastAPI

log = structlog.get_logger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The controller owns SIGTERM/SIGINT/SIGHUP; uvicorn stops when told to, not on its own.
        yield


class ApiServer:
    """The API bound to `host:port` now (port 0: a free one), served by `serve(stop)`.

    Binding in the constructor makes a taken port an OSError at start-up, before any task
    runs, instead of uvicorn's sys.exit from inside the event loop.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8080) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._server = _EmbeddedServer(
            uvicorn.Config(
                app,
                log_config=None,  # structlog owns logging; uvicorn's own lines go to stdlib
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=5,
                server_header=False,
            )
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer requests until `stop` is set, then finish the requests in flight."""

        async def stop_when_told() -> None:
            await stop.wait()
            self._server.should_exit = True

        watcher = asyncio.create_task(stop_when_told(), name="api-stop")
        log.info("api_listening", url=self.url)
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            self._sock.close()
            log.info("api_stopped")


async def serve_api(app: FastAPI, host: str, port: int, stop: asyncio.Event) -> None:
    """Bind and serve until `stop` (see ApiServer to learn the port or fail early)."""
    await ApiServer(app, host, port).serve(stop)
