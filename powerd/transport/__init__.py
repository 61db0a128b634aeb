"""Publish/subscribe transport: MQTT for real deployments, an in-process broker for demos."""

from powerd.transport.base import (
    ConnectionState,
    LastWill,
    Message,
    OnConnect,
    PublishTimeout,
    PublishUnconfirmed,
    Transport,
    TransportError,
    topic_matches,
)
from powerd.transport.memory import MemoryBroker, MemoryTransport
from powerd.transport.mqtt import MqttConfig, MqttTransport

__all__ = [
    "ConnectionState",
    "LastWill",
    "MemoryBroker",
    "MemoryTransport",
    "Message",
    "MqttConfig",
    "MqttTransport",
    "OnConnect",
    "PublishTimeout",
    "PublishUnconfirmed",
    "Transport",
    "TransportError",
    "topic_matches",
]
