"""The restricted codec between verifier and user process: exact builtins by value, everything
else (subclasses of builtins included) by handle, and nothing else out of the decoder."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import pytest

from tangram_runner.codec import (
    FIRST_READ_B,
    MAX_DEPTH,
    CodecError,
    decode,
    encode,
    recv_msg,
)

EXACT = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


class Ref:
    """What a handle decodes to in these tests."""

    def __init__(self, hid: int) -> None:
        self.hid = hid


class Table:
    """Stands in for the user side's handle table."""

    def __init__(self) -> None:
        self.objs: list[Any] = []

    def handle_of(self, obj: Any) -> int:
        self.objs.append(obj)
        return len(self.objs) - 1


def roundtrip(value: Any) -> tuple[Any, Table]:
    t = Table()
    return decode(encode(value, t.handle_of), Ref), t


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**200,
        -(3**150),
        1.5,
        -0.0,
        float("inf"),
        float("-inf"),
        complex(1, -2),
        "",
        "héllo \u2603 \ud800",
        b"\x00\xff",
        [],
        [1, [2, [3]]],
        (1, "a", (None,)),
        {"a": [1, 2], 3: {4: 5}, (1, 2): frozenset({1})},
        {1, 2, "x"},
        frozenset(),
    ],
)
def test_exact_builtins_round_trip_by_value(value: Any) -> None:
    """Given a value of exact builtin types, when encoded and decoded, then it is equal and of the
    same types, with no handle made."""
    got, t = roundtrip(value)
    assert got == value and type(got) is type(value) and not t.objs
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, got) == math.copysign(1, value)


def test_nan_survives() -> None:
    """Given NaN, when round-tripped, then NaN."""
    got, _ = roundtrip(float("nan"))
    assert type(got) is float and math.isnan(got)


class AlwaysEqualStr(str):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


class AlwaysEqualList(list):  # type: ignore[type-arg]
    def __eq__(self, other: object) -> bool:
        return True


class AlwaysEqualInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize(
    "obj", [AlwaysEqualStr("x"), AlwaysEqualList([1]), AlwaysEqualInt(3), object(), lambda: 1, range(3)]
)
def test_subclasses_and_other_objects_cross_only_as_handles(obj: Any) -> None:
    """Given a subclass of a builtin (with a lying __eq__) or any other object, inside a list,
    when encoded, then it becomes a handle: the decoder never builds it."""
    got, t = roundtrip([obj, 1])
    assert type(got[0]) is Ref and t.objs == [obj] and got[1] == 1


def test_cycles_and_deep_nesting_become_handles() -> None:
    """Given a list containing itself and a list nested deeper than the limit, when encoded,
    then the cycle and the too-deep part are handles (no recursion error)."""
    a: list[Any] = [1]
    a.append(a)
    got, t = roundtrip(a)
    assert got[0] == 1 and type(got[1]) is Ref and t.objs == [a]
    deep: list[Any] = []
    cur = deep
    for _ in range(MAX_DEPTH + 10):
        cur.append([])
        cur = cur[0]
    got, t = roundtrip(deep)
    assert len(t.objs) == 1


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"Q", "unknown tag"),
        (b"NN", "trailing"),
        (b"i" + struct.pack("<I", 10) + b"\x01", "truncated"),
        (b"l" + struct.pack("<I", 1 << 30), "count larger"),
        (b"S" + struct.pack("<I", 1) + b"l" + struct.pack("<I", 0), "unhashable"),
        (b"d" + struct.pack("<I", 1) + b"d" + struct.pack("<I", 0) + b"N", "unhashable"),
        (b"s" + struct.pack("<I", 1) + b"\xff", "bad text"),
        (b"l" + struct.pack("<I", 1) * 1 + b"l" * 0 + (b"l" + struct.pack("<I", 1)) * 200 + b"N", "deep"),
    ],
)
def test_malformed_messages_are_refused(data: bytes, why: str) -> None:
    """Given a malformed, oversized or too deep message, when decoded, then CodecError."""
    with pytest.raises(CodecError):
        decode(data, Ref)


def _exact_only(v: Any) -> bool:
    if type(v) is Ref:
        return True
    if type(v) not in EXACT:
        return False
    if type(v) in (list, tuple, set, frozenset):
        return all(_exact_only(x) for x in v)
    if type(v) is dict:
        return all(_exact_only(k) and _exact_only(x) for k, x in v.items())
    return True


def test_random_bytes_decode_to_exact_builtins_or_fail() -> None:
    """Given many random and mutated messages, when decoded, then each either fails with
    CodecError or yields only exact builtins and handles."""
    rng = random.Random(7)
    seeds = [encode([1, "a", {"k": (2.0, b"x")}, {3}], Table().handle_of), encode(None, Table().handle_of)]
    for i in range(3000):
        if i % 2:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data = bytearray(rng.randbytes(rng.randint(1, 40)))
            data[0] = rng.choice(b"NTFifcsbltSzdh")
        try:
            v = decode(bytes(data), Ref)
        except CodecError:
            continue
        assert _exact_only(v)


class Chunks:
    """A socket whose `recv` returns the given pieces, then end of stream."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = list(pieces)

    def recv(self, n: int) -> bytes:
        if not self.pieces:
            return b""
        piece = self.pieces.pop(0)
        if len(piece) > n:  # the kernel hands out at most n bytes; the rest stays queued
            self.pieces.insert(0, piece[n:])
            piece = piece[:n]
        return piece


def test_messages_arrive_whole_however_the_stream_splits_them() -> None:
    """Given a message split anywhere (inside its length, across reads, or larger than the
    first read), when received, then it comes back whole; at end of stream, None."""
    body = encode(["x" * 20_000, 1], Table().handle_of)
    wire = struct.pack("<I", len(body)) + body
    assert len(wire) > FIRST_READ_B
    for cuts in ([], [2], [4], [7, 9000], [1, 2, 3]):
        pieces, last = [], 0
        for c in [*cuts, len(wire)]:
            pieces.append(wire[last:c])
            last = c
        sock = Chunks(*pieces)
        assert recv_msg(sock) == body
        assert recv_msg(sock) is None


def test_a_second_message_before_the_answer_is_refused() -> None:
    """Given a peer that sends two messages at once (the sides take turns), when received,
    then CodecError rather than one of them read as the answer to a later request."""
    one = struct.pack("<I", 1) + b"N"
    with pytest.raises(CodecError):
        recv_msg(Chunks(one + one))


def test_a_message_cut_short_is_refused() -> None:
    with pytest.raises(CodecError):
        recv_msg(Chunks(struct.pack("<I", 10) + b"N"))
    with pytest.raises(CodecError):
        recv_msg(Chunks(b"\x01\x00"))
