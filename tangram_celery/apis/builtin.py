"""Two small real APIs for the embedded default: a calculator and a documentation search.

`docsearch` searches the docstrings of the Python standard library's modules (real text shipped
with the interpreter), a stand-in for the web search of DeepSearch-style agents.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import pkgutil
import re
import sysconfig
from pathlib import Path
from typing import Any

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


MAX_BITS = 4096  # integers beyond ~1233 digits are refused before they are computed
MAX_DEPTH = 64  # nesting of the expression tree


def _check_bits(value: float | int) -> float | int:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"result larger than {MAX_BITS} bits")
    return value


def _binop(op: ast.operator, left: float | int, right: float | int) -> float | int:
    """One operation, refused *before* computing when its integer result would be too large: a
    huge power holds the GIL for seconds (and stalls the worker's heart-beats)."""
    if isinstance(left, int) and isinstance(right, int):
        lb, rb = left.bit_length(), right.bit_length()
        if (
            isinstance(op, ast.Pow)
            and right > 0
            and abs(left) > 1
            and math.log2(abs(left)) * right > MAX_BITS
        ):
            raise ValueError(f"power result larger than {MAX_BITS} bits")
        if isinstance(op, ast.Mult) and lb + rb > MAX_BITS + 1:
            raise ValueError(f"product larger than {MAX_BITS} bits")
    if isinstance(op, ast.Pow) and abs(right) > 1_000_000:
        raise ValueError("exponent too large")
    return _check_bits(_OPS[type(op)](left, right))


def _eval(node: ast.AST, depth: int = 0) -> float | int:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value: float | int = node.value  # type: ignore[assignment]
        return _check_bits(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _binop(node.op, _eval(node.left, depth + 1), _eval(node.right, depth + 1))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand, depth + 1))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(request: dict[str, Any]) -> dict[str, Any]:
    """{'expr': '2*(3+4)'} -> {'value': 14}. Arithmetic only; anything else, a malformed
    expression, or a result too large to compute cheaply is a ValueError (status `failed`)."""
    expr = str(request.get("expr", ""))
    if len(expr) > 1000:
        raise ValueError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"not an arithmetic expression: {e}") from None
    return {"value": _eval(tree)}


@functools.lru_cache(maxsize=1)
def _corpus() -> list[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for info in sorted(pkgutil.iter_modules([str(stdlib)]), key=lambda m: m.name):
        mod = info.name
        if mod.startswith("_") or mod in {"antigravity", "this", "idlelib", "turtledemo", "test"}:
            continue
        path = stdlib / mod / "__init__.py" if info.ispkg else stdlib / f"{mod}.py"
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                tree = ast.parse(f.read())
            doc = ast.get_docstring(tree) or ""
        except (SyntaxError, OSError, ValueError):
            continue
        if doc:
            docs.append((mod, doc))
    return docs


def docsearch(request: dict[str, Any]) -> dict[str, Any]:
    """{'query': 'parse json', 'k': 3} -> ranked stdlib modules whose docstrings match."""
    words = [w for w in re.findall(r"[a-z0-9]+", str(request.get("query", "")).lower()) if len(w) > 2]
    k = max(1, min(int(request.get("k", 3)), 20))
    scored = []
    for mod, doc in _corpus():
        low = doc.lower()
        score = sum(low.count(w) for w in words) + sum(5 for w in words if w in mod)
        if score:
            scored.append((score, mod, doc.splitlines()[0][:200]))
    scored.sort(key=lambda t: (-t[0], t[1]))
    return {"hits": [{"module": m, "summary": s, "score": sc} for sc, m, s in scored[:k]]}


def echo(request: dict[str, Any]) -> dict[str, Any]:
    """Returns the request unchanged: a no-op API for overhead measurements."""
    return request


docsearch.warmup = _corpus  # type: ignore[attr-defined]  # built once per worker, at start
