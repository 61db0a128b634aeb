"""An in-process broker with MQTT's semantics for what powerd uses, for demos and logic tests.

Topic filters with `+` and `#`, retained messages (an empty retained payload clears one),
last wills published when a client vanishes without disconnecting (`crash`), and a broker
that can be stopped and started: stopping drops every connection and forgets retained
messages (like Mosquitto without persistence); starting reconnects every client that has
not disconnected, restoring its subscriptions and running its `on_connect`. QoS is ignored:
delivery is immediate and never lost while connected.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from powerd.transport.base import (
    ConnectionState,
    LastWill,
    Message,
    OnConnect,
    Transport,
    TransportError,
    check_filter,
    check_topic,
    topic_matches,
)


class MemoryBroker:
    def __init__(self) -> None:
        self.running = True
        # Clients between connect() and disconnect()/crash(), connected or waiting for us.
        self._members: list[MemoryTransport] = []
        self._retained: dict[str, bytes] = {}
        self._ids = itertools.count(1)

    def client(self, client_id: str | None = None) -> MemoryTransport:
        return MemoryTransport(self, client_id or f"memory-{next(self._ids)}")

    def route(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        message = Message(topic, payload)
        for client in self._members:
            if client.state is ConnectionState.CONNECTED and client.wants(topic):
                client.deliver(message)

    def retained(self, topic_filter: str) -> list[Message]:
        return [
            Message(topic, payload, retain=True)
            for topic, payload in self._retained.items()
            if topic_matches(topic_filter, topic)
        ]

    def has(self, client: MemoryTransport) -> bool:
        return client in self._members

    async def join(self, client: MemoryTransport) -> None:
        self._members.append(client)
        if self.running:
            await client.attach()

    def leave(self, client: MemoryTransport, will: LastWill | None) -> None:
        self._members.remove(client)
        if will is not None and self.running:
            self.route(will.topic, will.payload, will.retain)

    def stop(self) -> None:
        """The broker goes down: every client loses its connection; retained state is lost."""
        self.running = False
        for client in self._members:
            client.lose_connection()
        self._retained.clear()

    async def start(self) -> None:
        """The broker comes back: clients that want a connection get one."""
        self.running = True
        for client in list(self._members):
            await client.attach()


class MemoryTransport(Transport):
    def __init__(self, broker: MemoryBroker, client_id: str) -> None:
        self.broker = broker
        self.client_id = client_id
        self._subscriptions: dict[str, int] = {}
        self._state = ConnectionState.CLOSED
        self._connected = asyncio.Event()
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._will: LastWill | None = None
        self._on_connect: OnConnect | None = None

    @property
    def state(self) -> ConnectionState:
        return self._state

    def _set_state(self, state: ConnectionState) -> None:
        self._state = state
        if state is ConnectionState.CONNECTED:
            self._connected.set()
        else:
            self._connected.clear()

    def wants(self, topic: str) -> bool:
        return any(topic_matches(f, topic) for f in self._subscriptions)

    def deliver(self, message: Message) -> None:
        self._queue.put_nowait(message)

    async def connect(
        self, will: LastWill | None = None, on_connect: OnConnect | None = None
    ) -> None:
        if self.broker.has(self):
            raise RuntimeError("already connected or connecting")
        self._will = will
        self._on_connect = on_connect
        self._queue = asyncio.Queue()
        self._set_state(ConnectionState.CONNECTING)
        await self.broker.join(self)

    async def attach(self) -> None:
        self._set_state(ConnectionState.CONNECTED)
        for topic_filter in self._subscriptions:
            for message in self.broker.retained(topic_filter):
                self.deliver(message)
        if self._on_connect is not None:
            await self._on_connect()

    def lose_connection(self) -> None:
        self._set_state(ConnectionState.DISCONNECTED)

    async def wait_connected(self) -> None:
        await self._connected.wait()

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        check_topic(topic)
        if self._state is not ConnectionState.CONNECTED:
            raise TransportError(f"not connected ({self._state}); dropped message to {topic}")
        self.broker.route(topic, payload, retain)
        await asyncio.sleep(0)  # a publish is a suspension point, as over a network

    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        check_filter(topic_filter)
        self._subscriptions[topic_filter] = qos
        if self._state is ConnectionState.CONNECTED:
            for message in self.broker.retained(topic_filter):
                self.deliver(message)

    async def messages(self) -> AsyncIterator[Message]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def disconnect(self) -> None:
        self._leave(will=None)

    def crash(self) -> None:
        """Vanish without a clean disconnect (process killed, network cut): the will fires."""
        self._leave(will=self._will)

    def _leave(self, will: LastWill | None) -> None:
        if self.broker.has(self):
            self.broker.leave(self, will)
        self._set_state(ConnectionState.CLOSED)
        self._queue.put_nowait(None)
