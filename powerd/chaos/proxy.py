"""A loopback TCP proxy that can be cut: a network partition of one client, on demand.

`cut()` aborts every connection through it (a reset, no goodbye: the broker fires the
client's last will) and stops listening, so reconnects are refused until `restore()`.
Loopback only: it listens on and connects to 127.0.0.1, never another address.
"""

from __future__ import annotations

import asyncio
import contextlib

from powerd.testing.mosquitto import free_port

LOOPBACK = "127.0.0.1"


class TcpProxy:
    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"mqtt://{LOOPBACK}:{self.port}"

    @property
    def cut_off(self) -> bool:
        return self._server is None

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, LOOPBACK, self.port)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            writer.transport.abort()  # the broker is down: so is this path
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst), name=f"proxy-{self.port}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side gone: so is the other (abort, like a cable pulled, no FIN dance).
            dst.transport.abort()
            self._writers.discard(dst)
