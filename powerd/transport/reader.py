"""Reading MQTT packets in bulk for paho, on one connection.

paho reads a packet in three or more `recv` calls (the command byte, each byte of the
length, the body), then builds an `MQTTMessage`, a debug log line and, at QoS 1, a PUBACK
queued and sent on its own. About 30 µs a packet: at 10k GPUs (~5,000 packets a second in)
the controller's largest cost. `PacketReader` takes paho's place in the event loop's reader
callback: one `recv` of whatever the socket has, every complete packet cut out of it, each
PUBLISH at QoS 0 or 1 handed straight to `deliver`, and the PUBACKs of the pass queued as
one write, in the order their messages came (MQTT 3.1.1, 4.6). Every other packet (the
acknowledgements of what we publish, SUBACK, PINGRESP, QoS 2, anything under MQTT 5, a
PUBLISH too short to parse) goes to paho's own handler as though paho had read it, so its
state (in-flight messages, keepalive, subscriptions) is kept as before.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.exception import MalformedPacket

READ_BYTES = 65536  # one recv; loopback hands over up to this much at once
_PUBLISH = 0x30
_PUBACK = b"\x40\x02"  # PUBACK, remaining length 2 (the message id follows)
_MAX_LENGTH_BYTES = 4  # the remaining length takes one to four bytes

# paho's internals the reader uses: its state after a packet, its handler, its send queue,
# its error path and its keepalive clock.
_PAHO_PARTS = (
    "_in_packet",
    "_packet_handle",
    "_packet_queue",
    "_loop_rc_handle",
    "_msgtime_mutex",
    "_last_bytes_received",
    "_protocol",
    "_manual_ack",
    "_sock",
    "_easy_log",
)

Deliver = Callable[[bytes, bytes, bool], None]  # (topic, payload, retain)


class PacketReader:
    """Reads for one paho client (one connection): `install` once it is connected."""

    __slots__ = ("_deliver", "_need", "_paho", "_paho_read", "_rest")

    def __init__(self, paho: mqtt.Client, deliver: Deliver) -> None:
        self._paho = paho
        self._deliver = deliver
        self._paho_read = paho.loop_read
        self._rest = bytearray()  # the start of a packet not yet complete
        self._need = 0  # bytes `_rest` must reach before another parse can get further

    @staticmethod
    def fits(paho: mqtt.Client) -> bool:
        """Whether this paho has the parts the reader works with (paho-mqtt 2.x does); with
        another, paho keeps reading for itself."""
        return all(hasattr(paho, name) for name in _PAHO_PARTS) and isinstance(
            getattr(paho, "_in_packet", None), dict
        )

    def install(self) -> None:
        """Take over paho's reads (aiomqtt's reader callback calls `loop_read`)."""
        self._paho.loop_read = self.loop_read  # type: ignore[method-assign]

    @property
    def buffered(self) -> int:
        return len(self._rest)

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        paho: Any = self._paho
        if paho._in_packet["command"] != 0:
            # paho had begun a packet before we took over: let it finish that one.
            return self._paho_read(max_packets)
        sock = paho._sock
        if sock is None:
            return mqtt.MQTT_ERR_NO_CONN
        try:
            data = sock.recv(READ_BYTES)
        except (BlockingIOError, ssl.SSLWantReadError):
            return mqtt.MQTT_ERR_SUCCESS
        except ssl.SSLWantWriteError:
            paho._call_socket_register_write()
            return mqtt.MQTT_ERR_SUCCESS
        except OSError as exc:
            paho._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", exc)
            return paho._loop_rc_handle(mqtt.MQTT_ERR_CONN_LOST)  # type: ignore[no-any-return]
        if not data:
            return paho._loop_rc_handle(mqtt.MQTT_ERR_CONN_LOST)  # type: ignore[no-any-return]
        with paho._msgtime_mutex:
            paho._last_bytes_received = mqtt.time_func()  # what paho's keepalive watches
        if self._rest:
            self._rest += data
            if len(self._rest) < self._need:
                return mqtt.MQTT_ERR_SUCCESS
            data, self._rest = bytes(self._rest), bytearray()
        rc = self._handle(data)
        if rc != mqtt.MQTT_ERR_SUCCESS:
            return paho._loop_rc_handle(rc)  # type: ignore[no-any-return]
        return mqtt.MQTT_ERR_SUCCESS

    def _handle(self, buf: bytes) -> MQTTErrorCode:
        """Handle every complete packet in `buf`; keep the incomplete rest for the next read."""
        fast = self._paho._protocol != mqtt.MQTTv5 and not self._paho._manual_ack
        deliver = self._deliver
        mids: list[bytes] = []
        rc = mqtt.MQTT_ERR_SUCCESS
        pos, size = 0, len(buf)
        while pos < size:
            cmd = buf[pos]
            header = _remaining_length(buf, pos + 1)
            if header is None:  # the length itself is incomplete: parse once more has come
                self._keep(buf, pos, size + 1)
                break
            i, length = header
            if length < 0:
                rc = mqtt.MQTT_ERR_PROTOCOL
                break
            end = i + length
            if end > size:
                self._keep(buf, pos, end)
                break
            qos = (cmd >> 1) & 3
            if fast and cmd & 0xF0 == _PUBLISH and qos < 2 and length >= 2:
                topic_end = i + 2 + (buf[i] << 8 | buf[i + 1])
                payload_at = topic_end + 2 * qos  # QoS 1: the message id after the topic
                if payload_at <= end:
                    if qos:
                        mids.append(buf[topic_end:payload_at])
                    deliver(buf[i + 2 : topic_end], buf[payload_at:end], bool(cmd & 1))
                    pos = end
                    continue
            rc = self._to_paho(cmd, length, buf[i:end])
            pos = end
            if rc != mqtt.MQTT_ERR_SUCCESS:
                break
        if mids:
            self._paho._packet_queue(mqtt.PUBACK, _PUBACK + _PUBACK.join(mids), 0, 0)
        return rc

    def _keep(self, buf: bytes, pos: int, need: int) -> None:
        self._rest = bytearray(buf[pos:])
        self._need = need - pos

    def _to_paho(self, cmd: int, length: int, body: bytes) -> MQTTErrorCode:
        """One whole packet to paho's handler, in the state its own reader leaves."""
        paho: Any = self._paho
        paho._in_packet = _in_packet(cmd, length, body)
        try:
            rc: MQTTErrorCode = paho._packet_handle()
        except MalformedPacket as exc:
            paho._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            rc = mqtt.MQTT_ERR_PROTOCOL
        finally:
            paho._in_packet = _in_packet(0, 0, b"")
        return rc


def _remaining_length(buf: bytes, at: int) -> tuple[int, int] | None:
    """(where the packet's body starts, its length) from the remaining length at `at`: 7
    bits a byte, low bits first, the high bit set on all but the last byte. Length -1: more
    than four bytes (a broken packet); None: `buf` ends within it."""
    length = 0
    for n, i in enumerate(range(at, min(len(buf), at + _MAX_LENGTH_BYTES))):
        byte = buf[i]
        length |= (byte & 0x7F) << (7 * n)
        if byte < 0x80:
            return i + 1, length
    return (at, -1) if len(buf) >= at + _MAX_LENGTH_BYTES else None


def _in_packet(cmd: int, length: int, body: bytes) -> dict[str, Any]:
    return {
        "command": cmd,
        "have_remaining": 1 if cmd else 0,
        "remaining_count": [],
        "remaining_mult": 1,
        "remaining_length": length,
        "packet": bytearray(body),
        "to_process": 0,
        "pos": 0,
    }
