"""Verifier side of an `assert_code` test: proxies for the user's objects (stdlib only).

A `Handle` stands for an object that lives in the user's process. Using it (call, attribute,
item, iteration, len, bool, `in`, str/repr/format) is a request to that process, whose answer
comes back through the restricted codec: exact builtin values, or more handles. The user's
`__eq__`, `__hash__` and ordering methods are never asked: a handle equals another handle only
if both name the same object, and a value only through the object's *builtin base value*
(for instances of subclasses of int, float, str, list, dict, ...: `dict(counter)`), which the
user process sends as an exact builtin and is compared here, by the builtin's own `==`.
Arithmetic on a handle works the same way, on that base value. Exceptions raised in the user
process come back as the builtin exception class of the same name (the nearest builtin in the
class's MRO), or `RemoteError`; never as `SystemExit`/`KeyboardInterrupt`, and `StopIteration`
only from `next()` (else a function raising it would silently end a test's `for` loop).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import math
import operator
import sys
import types
import weakref
from typing import Any

from tangram_runner.codec import (
    Unencodable,
    decode,
    encode,
    recv_msg,
    send_msg,
)


class RemoteError(Exception):
    """An exception of user code with no builtin counterpart the test could catch."""


class UserProcessGone(Exception):
    """The user's process closed the connection (it exited, crashed or was killed)."""


TEST_FILENAME = "<test>"  # what the verifier compiles assert_code as
_UNSET = object()
_NO_BASE = object()
_EXACT = (int, float, complex, str, bytes, tuple, list, dict, frozenset, set, bool)


def _remote_exception(name: str, msg: str, tb: str, op: str) -> BaseException:
    cls = getattr(builtins, name, None)
    ok = isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopAsyncIteration)
    if cls is StopIteration and op != "next":
        ok = False
    exc: BaseException = RemoteError(f"{name}: {msg}")
    if ok:
        try:
            exc = cls(msg)  # type: ignore[misc]
        except Exception:  # a builtin with a stricter constructor (UnicodeDecodeError)
            pass
    if tb:
        exc.add_note("in user code:\n" + tb.rstrip()[-800:])
    return exc


class Conn:
    """The verifier's connection to one user process."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.proxies: dict[int, weakref.ref[Handle]] = {}  # (a plain dict: cheap to set up)
        self.released: list[int] = []

    # codec callbacks
    def handle_of(self, obj: Any) -> int:
        if type(obj) is Handle and obj._tg_conn is self:
            return int(obj._tg_id)
        if type(obj) is RemoteModule:
            return int(obj.__tangram_handle__._tg_id)
        raise Unencodable(f"cannot pass a {type(obj).__name__} to user code (only builtin values)")

    def from_handle(self, hid: int) -> Handle:
        ref = self.proxies.get(hid)
        h = ref() if ref is not None else None
        if h is None:
            if hid in self.released:  # released and sent back before the release went out
                self.released.remove(hid)
            h = Handle(self, hid)
            self.proxies[hid] = weakref.ref(h)
        return h

    def _release(self, hid: int) -> None:
        self.proxies.pop(hid, None)
        self.released.append(hid)

    def receive(self) -> Any:
        try:
            data = recv_msg(self.sock)
        except OSError as e:
            raise UserProcessGone(f"user process connection failed: {e}") from None
        if data is None:
            raise UserProcessGone("the user process exited (or closed its connection)")
        return decode(data, self.from_handle)

    def request(self, op: str, hid: int, *args: Any) -> Any:
        releases, self.released = self.released, []
        payload = encode((op, hid, args, releases), self.handle_of)
        try:
            send_msg(self.sock, payload)
        except OSError as e:
            raise UserProcessGone(f"user process connection failed: {e}") from None
        reply = self.receive()
        if type(reply) is not tuple or not reply:
            raise RemoteError("malformed reply from the user process")
        if reply[0] == "ok" and len(reply) == 3:
            return reply[1], reply[2]
        if reply[0] == "err" and len(reply) == 4 and all(type(x) is str for x in reply[1:]):
            raise _remote_exception(reply[1], reply[2], reply[3], op)
        raise RemoteError("malformed reply from the user process")

    def value(self, op: str, hid: int, *args: Any) -> Any:
        return self.request(op, hid, *args)[0]

    def call(self, hid: int, pos: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        result, back = self.request("call", hid, pos, kw)
        if type(back) is list:  # arguments mutated in place: mirror the change here
            for item in back:
                if type(item) is tuple and len(item) == 2:
                    _write_back(pos[item[0]] if type(item[0]) is int else kw.get(item[0]), item[1])
        return result


def _write_back(local: Any, new: Any) -> None:
    if type(local) is list and type(new) is list:
        local[:] = new
    elif type(local) in (dict, set) and type(new) is type(local):
        local.clear()
        local.update(new)


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise RemoteError(f"user code answered a {type(value).__name__} where a {kind.__name__} belongs")
    return value


class Handle:
    """An object in the user's process; see the module docstring."""

    __slots__ = ("__weakref__", "_tg_base", "_tg_conn", "_tg_id")
    _tg_conn: Conn
    _tg_id: int

    def __init__(self, conn: Conn, hid: int) -> None:
        object.__setattr__(self, "_tg_conn", conn)
        object.__setattr__(self, "_tg_id", hid)
        object.__setattr__(self, "_tg_base", _UNSET)

    def __del__(self) -> None:
        try:
            self._tg_conn._release(self._tg_id)
        except Exception:
            pass

    def _tg_value(self) -> Any:
        """The builtin base value (exact builtin), or _NO_BASE; fetched once."""
        b = self._tg_base
        if b is _UNSET:
            b = self._tg_conn.value("base", self._tg_id)
            if b is None or type(b) not in _EXACT:
                b = _NO_BASE
            object.__setattr__(self, "_tg_base", b)
        return b

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_tg_"):
            raise AttributeError(name)
        return self._tg_conn.value("getattr", self._tg_id, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._tg_conn.value("setattr", self._tg_id, name, value)

    def __delattr__(self, name: str) -> None:
        self._tg_conn.value("delattr", self._tg_id, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tg_conn.call(self._tg_id, args, kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._tg_conn.value("getitem", self._tg_id, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._tg_conn.value("setitem", self._tg_id, key, value)

    def __delitem__(self, key: Any) -> None:
        self._tg_conn.value("delitem", self._tg_id, key)

    def __iter__(self) -> Any:
        it = self._tg_conn.value("iter", self._tg_id)
        if type(it) is not Handle:
            raise RemoteError("user code's __iter__ did not return an iterator")
        return it

    def __next__(self) -> Any:
        return self._tg_conn.value("next", self._tg_id)

    def __len__(self) -> int:
        n: int = _typed(self._tg_conn.value("len", self._tg_id), int)
        return n

    def __bool__(self) -> bool:
        b: bool = _typed(self._tg_conn.value("bool", self._tg_id), bool)
        return b

    def __contains__(self, item: Any) -> bool:
        b: bool = _typed(self._tg_conn.value("contains", self._tg_id, item), bool)
        return b

    def __str__(self) -> str:
        s: str = _typed(self._tg_conn.value("str", self._tg_id), str)
        return s

    def __repr__(self) -> str:
        s: str = _typed(self._tg_conn.value("repr", self._tg_id), str)
        return s

    def __format__(self, spec: str) -> str:
        s: str = _typed(self._tg_conn.value("format", self._tg_id, spec), str)
        return s

    def __eq__(self, other: object) -> bool:
        if type(other) is Handle:
            return self._tg_conn is other._tg_conn and self._tg_id == other._tg_id
        b = self._tg_value()
        return False if b is _NO_BASE else bool(b == other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        b = self._tg_value()
        return hash(("tangram-handle", id(self._tg_conn), self._tg_id)) if b is _NO_BASE else hash(b)

    def _tg_operand(self) -> Any:
        b = self._tg_value()
        if b is _NO_BASE:
            raise TypeError("a user object without a builtin value cannot be used in arithmetic here")
        return b


def _unwrap(x: Any) -> Any:
    return x._tg_operand() if type(x) is Handle else x


def _binary(fn: Any, reflected: bool) -> Any:
    def op(self: Handle, other: Any) -> Any:
        a, b = self._tg_operand(), _unwrap(other)
        return fn(b, a) if reflected else fn(a, b)

    return op


def _unary(fn: Any) -> Any:
    def op(self: Handle, *rest: Any) -> Any:
        return fn(self._tg_operand(), *rest)

    return op


_fn: Any
for _name, _fn in {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "divmod": divmod,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
}.items():
    setattr(Handle, f"__{_name}__", _binary(_fn, False))
    setattr(Handle, f"__r{_name}__", _binary(_fn, True))
for _name, _fn in {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}.items():
    setattr(Handle, f"__{_name}__", _binary(_fn, False))
for _name, _fn in {
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": abs,
    "invert": operator.invert,
    "int": int,
    "float": float,
    "complex": complex,
    "index": operator.index,
    "round": round,
    "trunc": math.trunc,
    "floor": math.floor,
    "ceil": math.ceil,
}.items():
    setattr(Handle, f"__{_name}__", _unary(_fn))


class RemoteModule(types.ModuleType):
    """A module of the user's (imported in the user's process), as test code imports it."""

    __tangram_handle__: Handle

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__tangram_handle__, name)


class RemoteFinder:  # a meta path finder and loader (not the importlib.abc ABCs: they pull in
    # importlib.resources, pathlib, tempfile, ..., and every fork of the zygote would pay for them)
    """Last on `sys.meta_path`: a module the verifier's trusted path lacks is imported in the user
    process (`from solution import f` in test code), never from user files in the verifier."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        # only an import written in the test code itself; a library's optional import (`try:
        # import org.python.core`) must keep failing, not reach user files
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen") or "/importlib/" in frame.f_code.co_filename
        ):
            frame = frame.f_back  # type: ignore[assignment]
        if frame is None or frame.f_code.co_filename != TEST_FILENAME:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)  # type: ignore[arg-type]

    def create_module(self, spec: Any) -> types.ModuleType:
        got = self.conn.value("import", 0, spec.name)
        if type(got) is not tuple or len(got) != 2 or type(got[0]) is not Handle or type(got[1]) is not dict:
            raise ImportError(f"user code could not import {spec.name}")
        mod = RemoteModule(spec.name)
        mod.__tangram_handle__ = got[0]
        mod.__path__ = []  # so `import pkg.sub` asks for the submodule too
        for k, v in got[1].items():
            if type(k) is str:
                setattr(mod, k, v)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_importer(conn: Conn, trusted_path: list[str]) -> None:
    sys.path[:] = trusted_path  # (cached finders of other entries are simply not asked)
    sys.meta_path.append(RemoteFinder(conn))
