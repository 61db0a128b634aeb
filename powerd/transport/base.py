"""The publish/subscribe transport the agent and the controller speak through.

Both ends only need what MQTT gives: publish with QoS and retain, subscribe with `+`/`#`
filters, a last will the broker publishes when a client vanishes, and a stream of
messages. A transport keeps its connection up by itself (reconnecting, resubscribing) and
reports its state, so callers only decide what to do while it is down.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, Self

OnConnect = Callable[[], Awaitable[None]]


class TransportError(Exception):
    """A publish or subscribe that could not be done (not connected, timed out, refused)."""


class PublishUnconfirmed(TransportError):
    """A QoS 1 message the broker did not acknowledge, given up for good: the transport
    never sends it again (docs/decisions/0001-mqtt-qos1-timeouts.md).

    `sent` says what may still happen to it. False: it never left this process (the window
    held it back) and now never will, so nobody receives it. True: it was written to the
    connection before the PUBACK failed to come, so the broker may have it and may deliver
    it, even after this error is raised; only a reply from its receiver can tell.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class PublishTimeout(PublishUnconfirmed):
    """No PUBACK within the transport's timeout (the connection itself may still be up)."""


class ConnectionState(StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"  # lost; reconnecting
    CLOSED = "closed"  # disconnect() called, or never connected


@dataclass(frozen=True)
class LastWill:
    """Published by the broker for us when our connection drops without a clean disconnect."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool = False  # delivered from the broker's retained store


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT matching: `+` is one level, a trailing `#` is this level and everything below.

    As in MQTT, wildcards at the first level do not match topics starting with `$`.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_parts = topic_filter.split("/")
    t_parts = topic.split("/")
    for i, f in enumerate(f_parts):
        if f == "#":
            return i == len(f_parts) - 1
        if i >= len(t_parts) or (f not in ("+", t_parts[i])):
            return False
    return len(f_parts) == len(t_parts)


def check_filter(topic_filter: str) -> None:
    """ValueError unless the filter is valid MQTT (`#` last and alone, `+` alone in its level)."""
    parts = topic_filter.split("/")
    for i, part in enumerate(parts):
        if ("#" in part and (part != "#" or i != len(parts) - 1)) or ("+" in part and part != "+"):
            raise ValueError(f"invalid topic filter {topic_filter!r}")
    if not topic_filter:
        raise ValueError("empty topic filter")


def check_topic(topic: str) -> None:
    """ValueError unless this is a topic one may publish to (no wildcards)."""
    if not topic or "+" in topic or "#" in topic:
        raise ValueError(f"cannot publish to {topic!r}")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel tasks and wait until every one has ended.

    Python 3.11's asyncio.wait_for (which MqttTransport awaits acknowledgements with) swallows a
    cancellation that arrives just as its operation completes; the task then carries on.
    So cancel again until each has really ended.
    """
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)


class Transport(ABC):
    """One client connection to a broker, kept up in the background once `connect` is called.

    Usage: `await t.connect(will, on_connect)`, `await t.subscribe(filter)`, then iterate
    `t.messages()` (one consumer); `publish` raises TransportError while disconnected.
    `on_connect` runs after every (re)connection, once subscriptions are restored: the place
    to republish retained state the broker may have lost or replaced with the last will.
    """

    @property
    @abstractmethod
    def state(self) -> ConnectionState: ...

    @abstractmethod
    async def connect(
        self, will: LastWill | None = None, on_connect: OnConnect | None = None
    ) -> None:
        """Start connecting; returns at once (see `wait_connected`)."""

    @abstractmethod
    async def wait_connected(self) -> None:
        """Return once connected (at once if already)."""

    @abstractmethod
    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        """Send one message; TransportError when it cannot be handed to the broker."""

    async def publish_many(
        self, messages: Sequence[tuple[str, bytes]], qos: int = 1, retain: bool = False
    ) -> int:
        """Hand a batch to the broker without waiting for each acknowledgement in turn;
        returns how many could not be handed over. Delivery is QoS's business: what the
        sender needs to know (the cap was applied) comes back in the receiver's own reply."""
        failed = 0
        for topic, payload in messages:
            try:
                await self.publish(topic, payload, qos=qos, retain=retain)
            except TransportError:
                failed += 1
        return failed

    @abstractmethod
    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """Subscribe now if connected, and again after every reconnection."""

    @abstractmethod
    def messages(self) -> AsyncIterator[Message]:
        """Messages from every subscription, across reconnections; ends after `disconnect`."""

    @abstractmethod
    async def disconnect(self) -> None:
        """Close cleanly: the broker does not publish the last will. Stops reconnecting."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.disconnect()
