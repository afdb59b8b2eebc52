"""The restricted codec between a verifier and a user process (stdlib only).

Only values of *exact* builtin types cross by value: None, bool, int, float (nan and inf
included), complex, str, bytes, list, tuple, dict, set, frozenset. Decoding builds nothing else:
no eval, no pickle, no user class, no subclass of a builtin. Every other object, including an
instance of a subclass of a builtin (a `str` whose `__eq__` always returns True), is encoded as a
handle: an integer naming the object in the process that holds it; the encoder asks `handle_of`
for it (the user side registers the object, the verifier side passes back handles it received).

Wire format, little-endian: a one-byte tag, then
  N T F                   None, True, False
  i <u32 n> <n bytes>     int, two's complement
  f <8 bytes>  c <16>     float, complex (IEEE 754 doubles)
  s b <u32 n> <n bytes>   str (UTF-8, surrogates passed through), bytes
  l t S z <u32 n> items   list, tuple, set, frozenset
  d <u32 n> k v ...       dict
  h <u32 id>              handle
Bounds: nesting depth, message size; a cyclic container is sent as a handle by the user side.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 100
MAX_MESSAGE_B = 32 << 20
FIRST_READ_B = 8192

_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_S_HEAD = struct.Struct("<BI")  # a tag and a length
_F_HEAD = struct.Struct("<Bd")  # a tag and a double
_SEQ_TAGS: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z"}
_SEQ_TYPES = {b"l": list, b"t": tuple, b"S": set, b"z": frozenset}
# the tags as the integers that indexing bytes gives: the decoder compares those (no slice and
# no bytes object per tag, a verifier decodes every answer of user code), the encoder packs
# them with a length or a double (`_S_HEAD`, `_F_HEAD`)
_N, _T, _F, _I, _FL, _C, _S, _B, _H, _D = b"NTFifcsbhd"
_KINDS = {ord(k): t for k, t in _SEQ_TYPES.items()}


class CodecError(ValueError):
    """A message that is malformed, too large or too deep."""


class Unencodable(TypeError):
    """An object that must cross by handle where no handle can be made (verifier side)."""


def encode(obj: Any, handle_of: Callable[[Any], int]) -> bytes:
    """`obj` as bytes; objects that are not exact builtins go through `handle_of`."""
    out = bytearray()
    _enc(obj, handle_of, out, 0, set())
    if len(out) > MAX_MESSAGE_B:
        raise CodecError(f"message of {len(out)} bytes exceeds {MAX_MESSAGE_B}")
    return bytes(out)


def _enc(obj: Any, handle_of: Callable[[Any], int], out: bytearray, depth: int, path: set[int]) -> None:
    t = type(obj)
    if t is str:
        raw = obj.encode("utf-8", "surrogatepass")
        out += _S_HEAD.pack(_S, len(raw))
        out += raw
    elif t is int:
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out += _S_HEAD.pack(_I, len(raw))
        out += raw
    elif obj is None:
        out += b"N"
    elif t is bool:
        out += b"T" if obj else b"F"
    elif t is float:
        out += _F_HEAD.pack(_FL, obj)
    elif t is complex:
        out += b"c" + _C128.pack(obj.real, obj.imag)
    elif t is bytes:
        out += _S_HEAD.pack(_B, len(obj))
        out += obj
    elif t in _SEQ_TAGS or t is dict:
        if depth >= MAX_DEPTH or id(obj) in path:  # too deep, or a cycle: keep it where it is
            out += b"h" + _U32.pack(handle_of(obj))
            return
        path.add(id(obj))
        if t is dict:
            out += b"d" + _U32.pack(len(obj))
            for k, v in list(obj.items()):
                _enc(k, handle_of, out, depth + 1, path)
                _enc(v, handle_of, out, depth + 1, path)
        else:
            items = list(obj)
            out += _SEQ_TAGS[t] + _U32.pack(len(items))
            for item in items:
                _enc(item, handle_of, out, depth + 1, path)
        path.discard(id(obj))
        if len(out) > MAX_MESSAGE_B:
            raise CodecError(f"message exceeds {MAX_MESSAGE_B} bytes")
    else:
        out += b"h" + _U32.pack(handle_of(obj))


def decode(data: bytes, from_handle: Callable[[int], Any]) -> Any:
    """The value encoded in `data` (exact builtins; handles through `from_handle`)."""
    if len(data) > MAX_MESSAGE_B:
        raise CodecError("message too large")
    dec = _Decoder(bytes(data), from_handle)
    value = dec.value(0)
    if dec.pos != dec.end:
        raise CodecError(f"{dec.end - dec.pos} trailing bytes")
    return value


class _Decoder:
    __slots__ = ("data", "end", "from_handle", "pos")

    def __init__(self, data: bytes, from_handle: Callable[[int], Any]) -> None:
        self.data = data
        self.pos = 0
        self.end = len(data)
        self.from_handle = from_handle

    def _take(self, n: int) -> bytes:
        start = self.pos
        end = start + n
        if end > self.end:
            raise CodecError("truncated message")
        self.pos = end
        return self.data[start:end]

    def _u32(self) -> int:
        start = self.pos
        if start + 4 > self.end:
            raise CodecError("truncated message")
        self.pos = start + 4
        n: int = _U32.unpack_from(self.data, start)[0]
        return n

    def _count(self) -> int:
        n = self._u32()
        if n > self.end - self.pos:  # every item takes at least one byte
            raise CodecError("count larger than the message")
        return n

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError("nested too deep")
        pos = self.pos
        if pos >= self.end:
            raise CodecError("truncated message")
        tag = self.data[pos]
        self.pos = pos + 1
        if tag == _S:
            return self._text()
        if tag == _I:
            return int.from_bytes(self._take(self._u32()), "little", signed=True)
        if tag == _N:
            return None
        if tag == _T:
            return True
        if tag == _F:
            return False
        if tag == _H:
            return self.from_handle(self._u32())
        if tag == _FL:
            if pos + 9 > self.end:
                raise CodecError("truncated message")
            self.pos = pos + 9
            return _F64.unpack_from(self.data, pos + 1)[0]
        if tag == _C:
            re, im = _C128.unpack(self._take(16))
            return complex(re, im)
        if tag == _B:
            return self._take(self._u32())
        if tag == _D:
            return self._dict(depth)
        return self._items(tag, depth)

    def _text(self) -> str:
        try:
            return self._take(self._u32()).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise CodecError(f"bad text: {e}") from None

    def _dict(self, depth: int) -> dict[Any, Any]:
        n = self._count()
        d = {}
        for _ in range(n):
            k = self.value(depth + 1)
            v = self.value(depth + 1)
            try:
                d[k] = v
            except TypeError as e:
                raise CodecError(f"unhashable dict key: {e}") from None
        return d

    def _items(self, tag: int, depth: int) -> Any:
        """A list, tuple, set or frozenset (`_KINDS`)."""
        kind = _KINDS.get(tag)
        if kind is None:
            raise CodecError(f"unknown tag {bytes([tag])!r}")
        n = self._count()
        items = [self.value(depth + 1) for _ in range(n)]
        if kind is list:
            return items
        try:
            return kind(items)
        except TypeError as e:
            raise CodecError(f"unhashable set item: {e}") from None


def send_msg(sock: Any, payload: bytes) -> None:
    """One length-prefixed message on a stream socket."""
    sock.sendall(_U32.pack(len(payload)) + payload)


def recv_msg(sock: Any) -> bytes | None:
    """The next message, or None at end of stream. Raises CodecError on a bad length, and on
    bytes past the message: the two sides take turns (a request, then its answer), so a peer
    never sends a second message before the first is answered. One `recv` reads a message of
    up to `FIRST_READ_B` whole."""
    data = sock.recv(FIRST_READ_B)
    if not data:
        return None
    if len(data) < 4:
        rest = _recv_exact(sock, 4 - len(data))
        if rest is None:
            raise CodecError("connection closed inside a message")
        data += rest
    n = _U32.unpack_from(data)[0]
    if n > MAX_MESSAGE_B:
        raise CodecError(f"message of {n} bytes exceeds {MAX_MESSAGE_B}")
    if len(data) - 4 > n:
        raise CodecError("a second message before the first was answered")
    if len(data) - 4 == n:
        return data[4:]
    body = _recv_exact(sock, n - (len(data) - 4))
    if body is None:
        raise CodecError("connection closed inside a message")
    return data[4:] + body


def _recv_exact(sock: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise CodecError("connection closed inside a message")
            return None
        buf += chunk
    return bytes(buf)
