"""User side of an `assert_code` test: after the user's module ran, serve its objects to the
verifier, one request at a time, over the socket the runner passed in (stdlib only).

Nothing here is trusted: it runs in the user's process, which can patch or replace all of it.
It can only ever answer with values, handles or exceptions, which is no more than the user's
own functions could return; what passes or fails is decided in the verifier.
"""

from __future__ import annotations

import builtins
import marshal
import sys
import traceback
import types
from typing import Any

from tangram_runner.codec import (
    CodecError,
    decode,
    encode,
    recv_msg,
    send_msg,
)

_MUTABLE = (list, dict, set)
_HARNESS_DIR = __file__.rpartition("/")[0] + "/"  # the frames of this package's own modules
_BASES: tuple[Any, ...] = (int, float, complex, str, bytes, tuple, list, dict, frozenset, set)


def exception_record(e: BaseException) -> tuple[str, str, str, str]:
    """("err", builtin class name, message, traceback tail) for an exception of user code. The
    name is the nearest builtin class in its MRO, so `except ValueError` in a test still catches
    a user's subclass of it."""
    name = "Exception"
    for cls in type(e).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            name = cls.__name__
            break
    try:
        msg = str(e)
    except BaseException:
        msg = f"<unprintable {type(e).__name__}>"
    tb_obj = e.__traceback__
    while tb_obj is not None and tb_obj.tb_frame.f_code.co_filename.startswith(_HARNESS_DIR):
        tb_obj = tb_obj.tb_next  # the harness's own frames say nothing about the user's error
    try:
        tb = "".join(traceback.format_exception(type(e), e, tb_obj))[-1500:]
    except BaseException:
        tb = ""
    return ("err", name, f"{type(e).__name__}: {msg}" if name != type(e).__name__ else msg, tb)


def namespace_of(ns: dict[str, Any]) -> dict[str, Any]:
    """A module's public top-level names (dunders left out)."""
    return {k: v for k, v in ns.items() if type(k) is str and not (k.startswith("__") and k.endswith("__"))}


class Server:
    """Holds the objects the verifier has handles to, and answers its requests."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.objs: dict[int, Any] = {}
        self.ids: dict[int, int] = {}
        self.next_id = 1

    def handle_of(self, obj: Any) -> int:
        hid = self.ids.get(id(obj))
        if hid is None or self.objs.get(hid) is not obj:
            hid = self.next_id
            self.next_id += 1
            self.objs[hid] = obj
            self.ids[id(obj)] = hid
        return hid

    def from_handle(self, hid: int) -> Any:
        try:
            return self.objs[hid]
        except KeyError:
            raise CodecError(f"unknown handle {hid}") from None

    def send(self, value: Any) -> None:
        try:
            payload = encode(value, self.handle_of)
        except Exception as e:
            payload = encode(exception_record(e), self.handle_of)
        send_msg(self.sock, payload)

    def ready(self, ns: dict[str, Any]) -> None:
        self.send(("ready", namespace_of(ns)))

    def serve(self) -> None:
        """Answer requests until the verifier closes the connection."""
        while True:
            data = recv_msg(self.sock)
            if data is None:
                return
            try:
                req = decode(data, self.from_handle)
                op, hid, args, releases = req[0], req[1], req[2], req[3]
                for r in releases:
                    obj = self.objs.pop(r, None)
                    if obj is not None and self.ids.get(id(obj)) == r:
                        del self.ids[id(obj)]
                reply = self.dispatch(op, self.objs.get(hid), args)
            except BaseException as e:
                reply = exception_record(e)
            _flush()  # what the call printed, before the runner may end this process
            self.send(reply)

    def snapshot(self, value: Any) -> bytes:
        """`value`'s contents as bytes, to tell whether a call changed them: marshal's (in C;
        format 2 has no back-references, so equal contents give equal bytes), or the codec's
        for what marshal refuses (objects that are not exact builtins inside)."""
        try:
            return b"m" + marshal.dumps(value, 2)
        except ValueError:
            return b"c" + encode(value, self.handle_of)

    def dispatch(self, op: str, obj: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if op == "call":
            pos, kw = args
            before = {i: self.snapshot(a) for i, a in enumerate(pos) if type(a) in _MUTABLE}
            before.update({k: self.snapshot(a) for k, a in kw.items() if type(a) in _MUTABLE})
            result = obj(*pos, **kw)
            # arguments the call mutated in place go back, so the test sees them changed
            back = [
                (k, a)
                for k, a in [*enumerate(pos), *kw.items()]
                if k in before and self.snapshot(a) != before[k]
            ]
            return ("ok", result, back)
        if op == "import":
            mod = __import__(args[0])
            for part in args[0].split(".")[1:]:
                mod = getattr(mod, part)
            names = namespace_of(vars(mod)) if isinstance(mod, types.ModuleType) else {}
            return ("ok", (mod, names), [])
        return ("ok", _OPS[op](obj, *args), [])


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _base(obj: Any) -> Any:
    """The value of `obj` as its builtin base type (a Counter as a dict), None if it has none."""
    for t in _BASES:
        if isinstance(obj, t):
            return t.__str__(obj) if t is str else t(obj)
    return None


def _setattr(obj: Any, name: str, value: Any) -> None:
    setattr(obj, name, value)


def _setitem(obj: Any, key: Any, value: Any) -> None:
    obj[key] = value


def _delitem(obj: Any, key: Any) -> None:
    del obj[key]


_OPS: dict[str, Any] = {
    "getattr": getattr,
    "setattr": _setattr,
    "delattr": delattr,
    "getitem": lambda o, k: o[k],
    "setitem": _setitem,
    "delitem": _delitem,
    "iter": iter,
    "next": next,
    "len": lambda o: len(o),
    "bool": lambda o: bool(o),
    "contains": lambda o, x: bool(x in o),
    "str": lambda o: str.__str__(str(o)),
    "repr": lambda o: str.__str__(repr(o)),
    "format": lambda o, spec: str.__str__(format(o, spec)),
    "base": _base,
}
