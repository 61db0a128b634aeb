"""MQTT 3.1.1 packets to and from bytes, for a client: no sockets, no asyncio.

The encoders build what a client sends (CONNECT, PUBLISH at QoS 0 or 1, SUBSCRIBE,
UNSUBSCRIBE, the acknowledgements of incoming messages, PINGREQ, DISCONNECT); `Decoder`
takes what a broker sends, in chunks cut anywhere, and returns every complete packet. It is
on the controller's hot path (thousands of packets a second): each `feed` cuts all the
complete packets out of one buffer by slicing, and only the one to four bytes of a
remaining length are looked at one by one. Nothing here checks that a topic is UTF-8:
that, and what to do about it, is the caller's business.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PROTOCOL_LEVEL = 4  # MQTT 3.1.1
DEFAULT_MAX_PACKET_BYTES = 1 << 20
MAX_REMAINING_LENGTH = 268_435_455  # four bytes of seven bits
SUBACK_FAILURE = 0x80

PINGREQ = b"\xc0\x00"
DISCONNECT = b"\xe0\x00"

# CONNACK return codes (MQTT 3.1.1, 3.2.2.3)
CONNACK_REASONS = {
    0: "accepted",
    1: "unacceptable protocol version",
    2: "identifier rejected",
    3: "server unavailable",
    4: "bad user name or password",
    5: "not authorised",
}


class ProtocolError(Exception):
    """Bytes that are not MQTT 3.1.1 from a broker: the connection cannot go on."""


@dataclass(slots=True)
class Connack:
    session_present: bool
    return_code: int

    @property
    def reason(self) -> str:
        return CONNACK_REASONS.get(self.return_code, f"return code {self.return_code}")


@dataclass(slots=True)
class Publish:
    topic: bytes
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0  # 0 at QoS 0


@dataclass(slots=True)
class Puback:
    packet_id: int


@dataclass(slots=True)
class Pubrec:
    packet_id: int


@dataclass(slots=True)
class Pubrel:
    packet_id: int


@dataclass(slots=True)
class Pubcomp:
    packet_id: int


@dataclass(slots=True)
class Suback:
    packet_id: int
    granted: tuple[int, ...]  # per filter: the QoS granted, or SUBACK_FAILURE


@dataclass(slots=True)
class Unsuback:
    packet_id: int


@dataclass(slots=True)
class Pingresp:
    pass


Packet = Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Suback | Unsuback | Pingresp

# -- encoding ----------------------------------------------------------------------------------


def remaining_length(n: int) -> bytes:
    """The variable-length remaining length: 7 bits a byte, low bits first."""
    if n < 0x80:
        return bytes((n,))
    if n > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet of {n} bytes is larger than MQTT allows")
    out = bytearray()
    while True:
        n, low = divmod(n, 0x80)
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    if len(data) > 0xFFFF:
        raise ValueError("an MQTT string holds at most 65,535 bytes")
    return len(data).to_bytes(2, "big") + data


def _check_id(packet_id: int) -> None:
    if not 0 < packet_id <= 0xFFFF:
        raise ValueError(f"packet id {packet_id} is not in 1..65535")


def encode_connect(
    client_id: str,
    keepalive_s: int,
    *,
    clean_session: bool = True,
    username: str | None = None,
    password: str | None = None,
    will_topic: str | None = None,
    will_payload: bytes = b"",
    will_qos: int = 0,
    will_retain: bool = False,
) -> bytes:
    if not 0 <= keepalive_s <= 0xFFFF:
        raise ValueError(f"keepalive {keepalive_s} s is not in 0..65535")
    if will_qos not in (0, 1, 2):
        raise ValueError(f"will QoS {will_qos} is not 0, 1 or 2")
    flags = 0x02 if clean_session else 0
    body = [_string(client_id)]
    if will_topic is not None:
        flags |= 0x04 | will_qos << 3 | (0x20 if will_retain else 0)
        body += [_string(will_topic), _string(will_payload)]
    if username is not None:
        flags |= 0x80
        body.append(_string(username))
    if password is not None:
        flags |= 0x40
        body.append(_string(password))
    header = b"\x00\x04MQTT" + bytes((PROTOCOL_LEVEL, flags)) + keepalive_s.to_bytes(2, "big")
    payload = header + b"".join(body)
    return b"\x10" + remaining_length(len(payload)) + payload


def encode_publish(
    topic: str | bytes,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    packet_id: int = 0,
    *,
    dup: bool = False,
) -> bytes:
    """A PUBLISH at QoS 0 or 1 (the packet id only at 1)."""
    name = topic.encode() if isinstance(topic, str) else topic
    if len(name) > 0xFFFF:
        raise ValueError("a topic holds at most 65,535 bytes")
    first = 0x30 | (0x08 if dup else 0) | (0x01 if retain else 0)
    if qos == 0:
        length = 2 + len(name) + len(payload)
        return (
            bytes((first,))
            + remaining_length(length)
            + len(name).to_bytes(2, "big")
            + name
            + payload
        )
    if qos != 1:
        raise ValueError(f"QoS {qos}: this client publishes at 0 or 1")
    _check_id(packet_id)
    length = 4 + len(name) + len(payload)
    return (
        bytes((first | 0x02,))
        + remaining_length(length)
        + len(name).to_bytes(2, "big")
        + name
        + packet_id.to_bytes(2, "big")
        + payload
    )


def _ack(first: int, packet_id: int) -> bytes:
    _check_id(packet_id)
    return bytes((first, 2)) + packet_id.to_bytes(2, "big")


def encode_puback(packet_id: int) -> bytes:
    return _ack(0x40, packet_id)


def encode_pubrec(packet_id: int) -> bytes:
    return _ack(0x50, packet_id)


def encode_pubcomp(packet_id: int) -> bytes:
    return _ack(0x70, packet_id)


def encode_subscribe(packet_id: int, filters: Iterable[tuple[str, int]]) -> bytes:
    _check_id(packet_id)
    body = [packet_id.to_bytes(2, "big")]
    for topic_filter, qos in filters:
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS {qos} is not 0, 1 or 2")
        body += [_string(topic_filter), bytes((qos,))]
    if len(body) == 1:
        raise ValueError("SUBSCRIBE needs at least one filter")
    payload = b"".join(body)
    return b"\x82" + remaining_length(len(payload)) + payload


def encode_unsubscribe(packet_id: int, filters: Iterable[str]) -> bytes:
    _check_id(packet_id)
    body = [packet_id.to_bytes(2, "big")] + [_string(f) for f in filters]
    if len(body) == 1:
        raise ValueError("UNSUBSCRIBE needs at least one filter")
    payload = b"".join(body)
    return b"\xa2" + remaining_length(len(payload)) + payload


# -- decoding ----------------------------------------------------------------------------------

# Packet types a broker sends besides PUBLISH, and the flags their fixed header must have.
_ACK_TYPES: dict[int, type[Puback | Pubrec | Pubrel | Pubcomp | Unsuback]] = {
    4: Puback,
    5: Pubrec,
    6: Pubrel,
    7: Pubcomp,
    11: Unsuback,
}
_FLAGS = {2: 0, 4: 0, 5: 0, 6: 2, 7: 0, 9: 0, 11: 0, 13: 0}
_NAMES = {2: "CONNACK", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP", 9: "SUBACK"}
_NAMES |= {11: "UNSUBACK", 13: "PINGRESP"}
_PINGRESP = Pingresp()


class Decoder:
    """Packets from a broker, out of a byte stream fed in chunks cut anywhere.

    `feed` returns every packet the stream now holds complete, in order, and keeps the
    start of an incomplete one for the next call. A packet larger than `max_packet_bytes`
    (its remaining length) raises ProtocolError as soon as its length is read, so a broker
    cannot make us buffer without end. After a ProtocolError the stream is lost: use a new
    decoder for a new connection.
    """

    __slots__ = ("_need", "_rest", "max_packet_bytes")

    def __init__(self, max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES) -> None:
        self.max_packet_bytes = max_packet_bytes
        self._rest = bytearray()  # the start of a packet not yet complete
        self._need = 0  # bytes `_rest` must reach before parsing again can get further

    @property
    def buffered(self) -> int:
        return len(self._rest)

    def feed(self, data: bytes) -> list[Packet]:
        if self._rest:
            self._rest += data
            if len(self._rest) < self._need:
                return []
            buf = bytes(self._rest)
            self._rest = bytearray()
        else:
            buf = data
        packets: list[Packet] = []
        append = packets.append
        pos, size = 0, len(buf)
        limit = self.max_packet_bytes
        while pos < size:
            first = buf[pos]
            i = pos + 1
            # A remaining length of one byte (acknowledgements, commands) or two (telemetry,
            # up to 16 KiB) without a call; three or four bytes in _long_length.
            if i < size and buf[i] < 0x80:
                length = buf[i]
                i += 1
            elif i + 1 < size and buf[i + 1] < 0x80:
                length = (buf[i] & 0x7F) | buf[i + 1] << 7
                i += 2
            else:
                header = _long_length(buf, i)
                if header is None:  # the length itself is not complete yet
                    self._keep(buf, pos, size + 1)
                    break
                i, length = header
            if length > limit:
                raise ProtocolError(f"packet of {length} bytes is larger than the {limit} accepted")
            end = i + length
            if end > size:
                self._keep(buf, pos, end)
                break
            if first >> 4 == 3:
                append(_publish(buf, first, i, end))
            else:
                append(_control(first, buf[i:end]))
            pos = end
        return packets

    def _keep(self, buf: bytes, pos: int, need: int) -> None:
        self._rest = bytearray(buf[pos:])
        self._need = need - pos


def _publish(buf: bytes, first: int, start: int, end: int) -> Publish:
    """The PUBLISH whose body is `buf[start:end]` (its first byte: `first`)."""
    qos = (first >> 1) & 3
    if qos == 3:
        raise ProtocolError("PUBLISH with QoS 3")
    if end - start < 2:
        raise ProtocolError("PUBLISH too short for its topic length")
    topic_end = start + 2 + (buf[start] << 8 | buf[start + 1])
    payload_at = topic_end + 2 if qos else topic_end
    if payload_at > end:
        raise ProtocolError("PUBLISH shorter than its topic")
    packet_id = buf[topic_end] << 8 | buf[topic_end + 1] if qos else 0
    if qos and not packet_id:
        raise ProtocolError("PUBLISH at QoS 1 or 2 with packet id 0")
    return Publish(
        buf[start + 2 : topic_end],
        buf[payload_at:end],
        qos,
        first & 1 != 0,
        first & 8 != 0,
        packet_id,
    )


def _long_length(buf: bytes, at: int) -> tuple[int, int] | None:
    """(where the body starts, the remaining length) from the length at `at`; None while
    `buf` ends within it; ProtocolError when it runs past four bytes."""
    length = 0
    for n in range(4):
        if at + n >= len(buf):
            return None
        byte = buf[at + n]
        length |= (byte & 0x7F) << (7 * n)
        if byte < 0x80:
            return at + n + 1, length
    raise ProtocolError("remaining length longer than four bytes")


def _control(first: int, body: bytes) -> Packet:
    """Every packet a broker sends but PUBLISH, from its first byte and its body."""
    kind = first >> 4
    name = _NAMES.get(kind)
    if name is None:
        raise ProtocolError(f"unexpected packet type {kind} from a broker")
    if first & 0x0F != _FLAGS[kind]:
        raise ProtocolError(f"{name} with flags {first & 0x0F:#x}")
    if kind == 13:
        if body:
            raise ProtocolError("PINGRESP with a body")
        return _PINGRESP
    if kind == 9:
        if len(body) < 3:
            raise ProtocolError("SUBACK without a return code")
        granted = tuple(body[2:])
        if any(code not in (0, 1, 2, SUBACK_FAILURE) for code in granted):
            raise ProtocolError(f"SUBACK with return codes {granted}")
        return Suback(body[0] << 8 | body[1], granted)
    if len(body) != 2:
        raise ProtocolError(f"{name} of {len(body)} bytes, not 2")
    if kind == 2:
        if body[0] & 0xFE:
            raise ProtocolError(f"CONNACK with flags {body[0]:#x}")
        return Connack(bool(body[0] & 1), body[1])
    packet_id = body[0] << 8 | body[1]
    if not packet_id:
        raise ProtocolError(f"{name} with packet id 0")
    return _ACK_TYPES[kind](packet_id)
