"""Bench: powerd's MQTT codec alone (powerd/transport/codec.py), no broker, no socket.

Decodes `--packets` telemetry-sized PUBLISH packets (a node's telemetry is ~1.2 KB of
JSON) from one buffer, fed in 64 KiB reads as a socket hands them over, and encodes as
many; then the same reads through the transport's whole receive path (its connection's
`data_received`: decoding, the PUBACKs of each read as one write to a socket stub, each
message onto the queue `messages()` reads). Prints the cost of each per packet, best of
`--repeat` runs.

    .venv/bin/python bench/mqtt_codec.py [--packets 100000] [--payload 1200] [--qos 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from powerd.transport import MqttConfig, MqttTransport
from powerd.transport.codec import Decoder, Publish, encode_publish
from powerd.transport.mqtt import _Connection

READ_BYTES = 65536


class NullSocket(asyncio.Transport):
    """Takes every write and sends nothing."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


async def receive_path(reads: list[bytes], n: int, repeat: int) -> float:
    """Best seconds for `reads` through a connection's data_received onto the queue."""
    best = float("inf")
    for _ in range(repeat):
        transport = MqttTransport(MqttConfig("127.0.0.1", max_queued_messages=n))
        conn = _Connection(transport._deliver, 0, 1 << 20, [], puback_timeout_s=5.0)
        conn.connection_made(NullSocket())
        t0 = time.perf_counter()
        for chunk in reads:
            conn.data_received(chunk)
        best = min(best, time.perf_counter() - t0)
        assert transport._queue.qsize() == n
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packets", type=int, default=100_000)
    parser.add_argument("--payload", type=int, default=1200)
    parser.add_argument("--qos", type=int, choices=(0, 1), default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.packets
    topics = [f"powerd/v1/nodes/node-{i % 1250:04d}/telemetry" for i in range(n)]
    payload = b"x" * args.payload

    def encode() -> list[bytes]:
        qos = args.qos
        return [
            encode_publish(t, payload, qos, False, (i % 65535) + 1) for i, t in enumerate(topics)
        ]

    encode_s = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        packets = encode()
        encode_s.append(time.perf_counter() - t0)
    stream = b"".join(packets)
    reads = [stream[i : i + READ_BYTES] for i in range(0, len(stream), READ_BYTES)]

    decode_s = []
    for _ in range(args.repeat):
        decoder = Decoder()
        got = 0
        t0 = time.perf_counter()
        for chunk in reads:
            got += len(decoder.feed(chunk))
        decode_s.append(time.perf_counter() - t0)
        assert got == n, (got, n)
    receive_s = asyncio.run(receive_path(reads, n, args.repeat))
    sample = Decoder().feed(packets[0])[0]
    assert isinstance(sample, Publish) and sample.payload == payload

    result = {
        "packets": n,
        "packet_bytes": len(packets[0]),
        "qos": args.qos,
        "decode_us_per_packet": round(min(decode_s) / n * 1e6, 3),
        "encode_us_per_packet": round(min(encode_s) / n * 1e6, 3),
        "receive_path_us_per_packet": round(receive_s / n * 1e6, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{n:,} PUBLISH packets of {result['packet_bytes']} bytes at QoS {args.qos}, "
            f"best of {args.repeat}: decode {result['decode_us_per_packet']:.2f} µs a packet "
            f"(64 KiB reads), encode {result['encode_us_per_packet']:.2f} µs a packet; "
            f"whole receive path to the queue {result['receive_path_us_per_packet']:.2f} µs"
        )


if __name__ == "__main__":
    main()
