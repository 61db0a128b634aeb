"""A loopback proxy between MQTT clients and a real broker that reads the stream packet by
packet: it records every PUBLISH a client sends and can hold back or drop the broker's
PUBACKs, or cut the connections, so a test loses an acknowledgement exactly when it wants.

It frames packets itself (fixed header and remaining length, MQTT 3.1.1 section 2), apart
from the client's codec it is there to test.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from enum import Enum

PUBLISH, PUBACK = 3, 4


@dataclass(frozen=True)
class SeenPublish:
    """A PUBLISH on its way from a client to the broker."""

    connection: int  # 1 for the first connection the proxy took, 2 for the next...
    topic: str
    payload: bytes
    qos: int
    dup: bool
    packet_id: int  # 0 at QoS 0


class Pubacks(Enum):
    PASS = "pass"  # on to the client
    HOLD = "hold"  # kept until release_pubacks()
    DROP = "drop"  # gone: the client never hears of them


async def read_packet(reader: asyncio.StreamReader) -> bytes:
    """One whole packet, its fixed header included."""
    first = await reader.readexactly(1)
    header = bytearray(first)
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        header.append(byte)
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return bytes(header) + await reader.readexactly(length)


def _body(packet: bytes) -> bytes:
    i = 1
    while packet[i] & 0x80:
        i += 1
    return packet[i + 1 :]


def parse_publish(connection: int, packet: bytes) -> SeenPublish:
    flags = packet[0] & 0x0F
    qos = (flags >> 1) & 0x03
    body = _body(packet)
    n = int.from_bytes(body[:2], "big")
    topic = body[2 : 2 + n].decode()
    rest = body[2 + n :]
    packet_id = 0
    if qos:
        packet_id, rest = int.from_bytes(rest[:2], "big"), rest[2:]
    return SeenPublish(connection, topic, rest, qos, bool(flags & 0x08), packet_id)


class MqttProxy:
    def __init__(self, broker_port: int, broker_host: str = "127.0.0.1") -> None:
        self.broker = (broker_host, broker_port)
        self.port = 0
        self.published: list[SeenPublish] = []
        self.pubacks = Pubacks.PASS
        self.dropped: list[int] = []  # packet ids of the PUBACKs dropped
        self.connections = 0
        self._held: list[tuple[asyncio.StreamWriter, bytes]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def held_pubacks(self) -> list[int]:
        return [int.from_bytes(p[2:4], "big") for _, p in self._held]

    def packet_ids(self, connection: int | None = None) -> list[int]:
        return [p.packet_id for p in self.published if connection in (None, p.connection)]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        """Cut every open connection at once, as a network that fails: the broker and the
        client each see their connection end; new ones are still taken."""
        writers, self._writers = self._writers, []
        for w in writers:
            w.transport.abort()
        self._held.clear()

    async def release_pubacks(self, packet_ids: set[int] | None = None) -> None:
        """Send the PUBACKs held so far (or those of `packet_ids`), in order, to clients
        still connected."""
        held, self._held = self._held, []
        for writer, packet in held:
            if packet_ids is not None and int.from_bytes(packet[2:4], "big") not in packet_ids:
                self._held.append((writer, packet))
            elif not writer.is_closing():
                writer.write(packet)
                await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.broker)
        except OSError:
            writer.transport.abort()
            return
        self._writers += [writer, up_writer]
        pumps = [
            asyncio.create_task(self._client_to_broker(connection, reader, up_writer)),
            asyncio.create_task(self._broker_to_client(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
                self._tasks.discard(task)
            for w in (writer, up_writer):
                w.transport.abort()

    async def _client_to_broker(
        self, connection: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                packet = await read_packet(reader)
                if packet[0] >> 4 == PUBLISH:
                    self.published.append(parse_publish(connection, packet))
                writer.write(packet)
                await writer.drain()

    async def _broker_to_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                packet = await read_packet(reader)
                if packet[0] >> 4 == PUBACK and self.pubacks is not Pubacks.PASS:
                    if self.pubacks is Pubacks.HOLD:
                        self._held.append((writer, packet))
                    else:
                        self.dropped.append(int.from_bytes(packet[2:4], "big"))
                    continue
                writer.write(packet)
                await writer.drain()
