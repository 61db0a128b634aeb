"""The MQTT 3.1.1 codec: every packet type a client sends or takes, round trips, bad input."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerd.transport.codec import (
    DISCONNECT,
    PINGREQ,
    Connack,
    Decoder,
    Packet,
    Pingresp,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Unsuback,
    encode_connect,
    encode_puback,
    encode_pubcomp,
    encode_publish,
    encode_pubrec,
    encode_subscribe,
    encode_unsubscribe,
    remaining_length,
)


def decode(data: bytes, **kw: int) -> list[Packet]:
    return Decoder(**kw).feed(data)


@pytest.mark.parametrize(
    ("n", "encoded"),
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (16_383, b"\xff\x7f"),
        (16_384, b"\x80\x80\x01"),
        (2_097_151, b"\xff\xff\x7f"),
        (2_097_152, b"\x80\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_remaining_length_as_the_standard_gives_it(n: int, encoded: bytes) -> None:
    # MQTT 3.1.1, table 2.4: the bounds of one to four bytes.
    assert remaining_length(n) == encoded


def test_remaining_length_past_four_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than MQTT allows"):
        remaining_length(268_435_456)


def test_connect_with_everything() -> None:
    packet = encode_connect(
        "powerd-n1",
        15,
        username="agent",
        password="s3cret",
        will_topic="p/n1/status",
        will_payload=b"offline",
        will_qos=1,
        will_retain=True,
    )
    body = (
        b"\x00\x04MQTT\x04"
        + bytes([0x80 | 0x40 | 0x20 | 0x08 | 0x04 | 0x02])  # user, password, will r/q1, clean
        + b"\x00\x0f"
        + b"\x00\x09powerd-n1"
        + b"\x00\x0bp/n1/status"
        + b"\x00\x07offline"
        + b"\x00\x05agent"
        + b"\x00\x06s3cret"
    )
    assert packet == b"\x10" + bytes([len(body)]) + body


def test_connect_plain() -> None:
    assert encode_connect("c", 0) == b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x00\x00\x01c"
    with pytest.raises(ValueError, match="keepalive"):
        encode_connect("c", 70_000)
    with pytest.raises(ValueError, match="QoS"):
        encode_connect("c", 1, will_topic="t", will_qos=3)


def test_publish_bytes_on_the_wire() -> None:
    assert encode_publish("a/b", b"hi") == b"\x30\x07\x00\x03a/bhi"
    assert encode_publish("a/b", b"hi", qos=1, retain=True, packet_id=0x0102, dup=True) == (
        b"\x3b\x09\x00\x03a/b\x01\x02hi"
    )
    with pytest.raises(ValueError, match="packet id"):
        encode_publish("a", b"", qos=1, packet_id=0)
    with pytest.raises(ValueError, match="QoS 2"):
        encode_publish("a", b"", qos=2, packet_id=1)


def test_subscribe_unsubscribe_ping_disconnect() -> None:
    assert encode_subscribe(10, [("a/#", 1), ("b/+", 0)]) == (
        b"\x82\x0e\x00\x0a\x00\x03a/#\x01\x00\x03b/+\x00"
    )
    assert encode_unsubscribe(11, ["a/#"]) == b"\xa2\x07\x00\x0b\x00\x03a/#"
    assert PINGREQ == b"\xc0\x00"
    assert DISCONNECT == b"\xe0\x00"
    with pytest.raises(ValueError, match="at least one"):
        encode_subscribe(1, [])
    with pytest.raises(ValueError, match="QoS"):
        encode_subscribe(1, [("a", 3)])


def test_acknowledgements_round_trip() -> None:
    assert decode(encode_puback(7)) == [Puback(7)]
    assert decode(encode_pubrec(0xFFFF)) == [Pubrec(0xFFFF)]
    assert decode(encode_pubcomp(1)) == [Pubcomp(1)]
    with pytest.raises(ValueError, match="packet id"):
        encode_puback(65_536)


def test_every_packet_a_broker_sends() -> None:
    stream = (
        b"\x20\x02\x01\x00"  # CONNACK, session present, accepted
        + b"\x20\x02\x00\x05"  # CONNACK, not authorised
        + b"\x40\x02\x00\x01"  # PUBACK
        + b"\x50\x02\x00\x02"  # PUBREC
        + b"\x62\x02\x00\x03"  # PUBREL
        + b"\x70\x02\x00\x04"  # PUBCOMP
        + b"\x90\x05\x00\x05\x01\x80\x00"  # SUBACK: granted 1, refused, granted 0
        + b"\xb0\x02\x00\x06"  # UNSUBACK
        + b"\xd0\x00"  # PINGRESP
        + b"\x33\x08\x00\x01t\x00\x07qos"  # PUBLISH QoS 1 retained
    )
    assert decode(stream) == [
        Connack(True, 0),
        Connack(False, 5),
        Puback(1),
        Pubrec(2),
        Pubrel(3),
        Pubcomp(4),
        Suback(5, (1, 0x80, 0)),
        Unsuback(6),
        Pingresp(),
        Publish(b"t", b"qos", 1, True, False, 7),
    ]
    assert Connack(False, 5).reason == "not authorised"


def test_decoder_keeps_a_partial_packet_for_the_next_feed() -> None:
    packet = encode_publish("a/b", b"x" * 300, qos=1, packet_id=3)
    decoder = Decoder()
    assert decoder.feed(packet[:1]) == []
    assert decoder.feed(packet[1:2]) == []  # the first byte of a two-byte length
    assert decoder.buffered == 2
    assert decoder.feed(packet[2:100]) == []
    assert decoder.feed(packet[100:] + b"\xd0\x00") == [
        Publish(b"a/b", b"x" * 300, 1, False, False, 3),
        Pingresp(),
    ]
    assert decoder.buffered == 0


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x30\xff\xff\xff\xff\x01", "longer than four bytes"),
        (b"\x30\x80\x80\x80\x01", "larger than"),  # 2 MiB, over the 1 MiB default
        (b"\x30\x01\x00", "too short"),
        (b"\x30\x03\x00\x05a", "shorter than its topic"),
        (b"\x32\x03\x00\x01a", "shorter than its topic"),  # QoS 1 without its packet id
        (b"\x36\x05\x00\x01a\x00\x01", "QoS 3"),
        (b"\x32\x05\x00\x01a\x00\x00", "packet id 0"),  # QoS 1 needs a non-zero id
        (b"\x40\x02\x00\x00", "PUBACK with packet id 0"),
        (b"\x62\x02\x00\x00", "PUBREL with packet id 0"),
        (b"\x00\x00", "unexpected packet type 0"),
        (b"\x10\x00", "unexpected packet type 1"),
        (b"\x80\x00", "unexpected packet type 8"),
        (b"\xf0\x00", "unexpected packet type 15"),
        (b"\x41\x02\x00\x01", "flags"),
        (b"\x60\x02\x00\x01", "flags"),  # PUBREL must carry 0b0010
        (b"\x20\x03\x00\x00\x00", "not 2"),
        (b"\x20\x02\x02\x00", "CONNACK with flags"),
        (b"\x90\x02\x00\x01", "without a return code"),
        (b"\x90\x03\x00\x01\x03", "return codes"),
        (b"\xd0\x01\x00", "PINGRESP with a body"),
    ],
)
def test_malformed_input_raises_protocol_error(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode(data)


def test_the_packet_size_bound_is_configurable_and_checked_before_buffering() -> None:
    big = encode_publish("a", b"x" * 5000)
    assert decode(big, max_packet_bytes=5003) == [Publish(b"a", b"x" * 5000)]
    decoder = Decoder(max_packet_bytes=5002)
    with pytest.raises(ProtocolError, match="larger than the 5002"):
        decoder.feed(big[:10])  # known from the length alone: nothing kept
    with pytest.raises(ProtocolError, match="larger than the 100"):
        Decoder(max_packet_bytes=100).feed(encode_publish("a", b"x" * 120))


publishes = st.builds(
    Publish,
    topic=st.binary(max_size=300),
    payload=st.binary(max_size=20_000),
    qos=st.sampled_from([0, 1]),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 0xFFFF),
)


@given(packets=st.lists(publishes, max_size=10), cuts=st.lists(st.integers(0, 300_000)))
@settings(max_examples=150, deadline=None)
def test_publish_round_trip_however_the_stream_is_cut(
    packets: list[Publish], cuts: list[int]
) -> None:
    expected = [
        Publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id if p.qos else 0)
        for p in packets
    ]
    stream = b"".join(
        encode_publish(p.topic, p.payload, p.qos, p.retain, p.packet_id, dup=p.dup) for p in packets
    )
    decoder = Decoder()
    got: list[Packet] = []
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    for lo, hi in itertools.pairwise(bounds):
        got += decoder.feed(stream[lo:hi])
    assert got == expected
    assert decoder.buffered == 0


@given(chunks=st.lists(st.binary(max_size=64), max_size=8))
@settings(max_examples=500, deadline=None)
def test_random_bytes_raise_nothing_but_protocol_error(chunks: list[bytes]) -> None:
    decoder = Decoder(max_packet_bytes=4096)
    try:
        for chunk in chunks:
            for packet in decoder.feed(chunk):
                assert isinstance(
                    packet,
                    Connack
                    | Publish
                    | Puback
                    | Pubrec
                    | Pubrel
                    | Pubcomp
                    | Suback
                    | Unsuback
                    | Pingresp,
                )
    except ProtocolError:
        pass
