"""Regenerate every figure quoted in README.md and docs/*.md from the committed result files.

    .venv/bin/python benchmarks/report.py           # rewrite the generated regions (make bench-report)
    .venv/bin/python benchmarks/report.py --check   # change nothing; fail if a region is stale

A figure lives in a generated region of the markdown. The region keeps its template in an HTML
comment (invisible when rendered) and the rendered text below it:

    <!-- bench:begin
    | coding | {{paper_act_over_time:targets/coding_fast_vs_static_pod|.2f}}x |
    -->
    | coding | 1.84x |
    <!-- bench:end -->

Placeholders in a template:
- `{{FILE:PATH|FORMAT|NONE}}`: the value at PATH ("/"-separated keys, list indices) in
  benchmarks/results/FILE.json, formatted with the Python format spec FORMAT (default: as is),
  NONE the text for a null value (default: an error).
- `{{= EXPR |FORMAT}}`: arithmetic over values: `[FILE:PATH]`, numbers, + - * / ( ), min, max,
  abs, float (for values stored as strings).
- `{{? EXPR |YES|NO}}`: YES if the comparison holds, else NO (for "met" / "not met").
- `{{!TEXT}}`: TEXT as is: a number that is an input or a target, not a measurement.

Everything else fails the run: a placeholder that does not resolve, a result file without
provenance (commit, dirty flag, machine yardstick: benchmarks/common.py), and a figure (a number
with a unit of time, a ratio like 2.3x, a percentage, a rate, a memory size, or a decimal alone
in a table cell) anywhere in README.md or docs/*.md outside a generated region, code, or an
inputs region `<!-- bench:inputs: WHY -->` ... `<!-- bench:end -->` (parameters, config values),
or literally in a template outside a placeholder.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

BEGIN = "<!-- bench:begin"
END = "<!-- bench:end -->"
INPUTS = re.compile(r"<!-- bench:inputs: *(\S.*?) *-->")
PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.S)
REF = re.compile(r"\[([A-Za-z0-9_.-]+):([^\]]*)\]")
NUM = r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    NUM
    + r"(?:"
    + r"\s?(?:ms|µs|us|s|sec|seconds?|min|minutes?|h|hours?)(?![\w])"  # durations
    + "|[x\u00d7](?![\\w])"  # ratios written against the number: 2.3x (or the times sign)
    + r"|\s?%"  # shares
    + r"|\s?(?:actions|requests|req|calls|rounds)?/s(?![\w])"  # rates
    + r"|\s?(?:MiB|GiB|KiB|MB|GB|KB)(?![\w/])"  # sizes (not GB/s, a bandwidth)
    + r"|\s?(?:GPU|instance)-s(?:econds)?(?![\w])"  # resource-time
    + r")"
)
TABLE_DECIMAL = re.compile(r"^\s*\*{0,2}-?\d[\d,]*\.\d+\*{0,2}\s*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


class ReportError(Exception):
    """A figure without a source, or a template that cannot be rendered."""


# ---- values -------------------------------------------------------------------------------------
@dataclass
class Sources:
    """Result files, loaded once; which were used and which lack provenance."""

    root: Path = RESULTS
    files: dict[str, Any] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def value(self, ref: str) -> Any:
        """The value at `FILE:PATH`."""
        name, sep, path = ref.strip().partition(":")
        if not sep:
            raise ReportError(f"{ref!r}: expected FILE:PATH")
        data = self._load(name)
        node: Any = data
        for part in filter(None, path.strip().split("/")):
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise ReportError(f"{name}.json has no {path!r} (stuck at {part!r})") from None
        return node

    def _load(self, name: str) -> Any:
        if name not in self.files:
            path = self.root / f"{name}.json"
            if not path.exists():
                raise ReportError(f"no result file {_rel(path)}")
            data = json.loads(path.read_text())
            prov = data.get("provenance") if isinstance(data, dict) else None
            if not isinstance(prov, dict) or not {"commit", "dirty", "machine_us"} <= prov.keys():
                raise ReportError(
                    f"{_rel(path)} has no provenance (commit, dirty, machine_us): rerun its benchmark"
                )
            self.files[name] = data
        self.used.add(name)
        return self.files[name]


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
_FUNCS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs, "float": float}


def evaluate(expr: str, sources: Sources) -> Any:
    """Arithmetic and comparisons over `[FILE:PATH]` values and numbers (nothing else)."""
    names: dict[str, Any] = {}

    def bind(m: re.Match[str]) -> str:
        key = f"_v{len(names)}"
        names[key] = sources.value(f"{m.group(1)}:{m.group(2)}")
        return key

    tree = ast.parse(REF.sub(bind, expr).strip(), mode="eval")

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS:
            left, right = ev(node.left), ev(node.comparators[0])
            if left is None or right is None:  # a figure that was not reached meets nothing
                return False
            return _OPS[type(node.ops[0])](left, right)
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
            return _FUNCS[node.func.id](*(ev(a) for a in node.args))
        raise ReportError(f"{expr!r}: only numbers, [FILE:PATH], + - * / ( ), comparisons, min/max/abs/float")

    try:
        return ev(tree)
    except TypeError as e:
        raise ReportError(f"{expr!r}: {e}") from None


def fmt(value: Any, spec: str, none: str | None, what: str) -> str:
    if value is None:
        if none is None:
            raise ReportError(f"{what} is null and the placeholder gives no text for that (|FORMAT|NONE)")
        return none
    if isinstance(value, (dict, list)):
        raise ReportError(f"{what} is a {type(value).__name__}, not a value")
    try:
        return format(value, spec)
    except (ValueError, TypeError) as e:
        raise ReportError(f"{what}: format {spec!r}: {e}") from None


def render_placeholder(body: str, sources: Sources) -> str:
    if body.startswith("!"):
        return body[1:]
    if body.startswith("?"):
        expr, *texts = body[1:].split("|")
        if len(texts) != 2:
            raise ReportError(f"{{{{?{body[1:]}}}}}: wants EXPR|YES|NO")
        return texts[0] if evaluate(expr, sources) else texts[1]
    if body.startswith("="):
        expr, *rest = body[1:].split("|")
        return fmt(evaluate(expr, sources), rest[0] if rest else "", rest[1] if len(rest) > 1 else None, expr)
    ref, *rest = body.split("|")
    return fmt(sources.value(ref), rest[0] if rest else "", rest[1] if len(rest) > 1 else None, ref.strip())


def render(template: str, sources: Sources) -> str:
    return PLACEHOLDER.sub(lambda m: render_placeholder(m.group(1), sources), template)


# ---- markdown -----------------------------------------------------------------------------------
@dataclass
class Region:
    start: int  # index of the begin line
    template: list[str]
    body_start: int  # first rendered line
    end: int  # index of the end line


def regions(lines: list[str], where: str) -> tuple[list[Region], list[tuple[int, int]]]:
    """Generated regions and inputs regions (begin, end line indexes) of a markdown file.

    A generated region: a line `<!-- bench:begin`, the template, a line `-->`, the rendered
    text, a line `<!-- bench:end -->`.
    """
    out: list[Region] = []
    inputs: list[tuple[int, int]] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith(BEGIN):
            if line != BEGIN:
                raise ReportError(f"{where}:{i + 1}: {BEGIN!r} stands alone on its line")
            close = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
            if close is None or end is None or end < close:
                raise ReportError(f"{where}:{i + 1}: bench region without its '-->' and {END!r} lines")
            out.append(Region(i, lines[i + 1 : close], close + 1, end))
            i = end + 1
            continue
        if INPUTS.fullmatch(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
            if end is None:
                raise ReportError(f"{where}:{i + 1}: inputs region without {END!r}")
            inputs.append((i, end))
            i = end + 1
            continue
        if line.startswith("<!-- bench"):
            raise ReportError(f"{where}:{i + 1}: unknown bench marker {line!r}")
        i += 1
    return out, inputs


def prose(line: str) -> str:
    """The line without inline code, links' targets and HTML comments."""
    line = re.sub(r"`[^`]*`", "", line)
    line = re.sub(r"\]\([^)]*\)", "]", line)
    return re.sub(r"<!--.*?-->", "", line)


def figures(text: str) -> list[str]:
    """Figure-like numbers in one line of prose (see the module doc)."""
    found = [m.group(0).strip() for m in FIGURE.finditer(text)]
    if text.lstrip().startswith("|"):
        found += [c.strip() for c in text.strip().strip("|").split("|") if TABLE_DECIMAL.match(c)]
    return found


def unsourced(lines: list[str], skip: set[int], where: str) -> list[str]:
    """Errors for figures outside generated regions, code and inputs regions."""
    errors = []
    fence = False
    comment = False
    for n, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
            continue
        if fence or n in skip:
            continue
        if comment or stripped.startswith("<!--"):
            comment = "-->" not in stripped
            continue
        for fig in figures(prose(line)):
            errors.append(
                f"{where}:{n + 1}: {fig!r} has no source: generate it in a bench region from a "
                "result file, or mark the paragraph as inputs (<!-- bench:inputs: WHY -->)"
            )
    return errors


def process(path: Path, sources: Sources, write: bool) -> tuple[bool, list[str]]:
    """Render the file's regions; returns (whether it changed, errors)."""
    where = _rel(path)
    text = path.read_text()
    lines = text.split("\n")
    try:
        found, inputs = regions(lines, where)
    except ReportError as e:
        return False, [str(e)]
    errors: list[str] = []
    skip: set[int] = set()
    for a, b in inputs:
        skip.update(range(a, b + 1))
    new = list(lines)
    for region in reversed(found):
        skip.update(range(region.start, region.end + 1))
        template = "\n".join(region.template)
        if "-->" in template:
            errors.append(f"{where}:{region.start + 1}: a template cannot contain '-->'")
            continue
        literal = PLACEHOLDER.sub("", template)
        for n, t in enumerate(literal.split("\n")):
            for fig in figures(prose(t)):
                errors.append(
                    f"{where}:{region.start + 1}: template line {n + 1}: {fig!r} is written literally: "
                    "use {{FILE:PATH}} for a measurement, {{!...}} for an input or a target"
                )
        try:
            body = render(template, sources).split("\n")
        except ReportError as e:
            errors.append(f"{where}:{region.start + 1}: {e}")
            continue
        new[region.body_start : region.end] = body
    errors += unsourced(lines, skip, where)
    changed = new != lines
    if write and changed and not errors:
        path.write_text("\n".join(new))
    return changed, errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; fail if a region is stale")
    ap.add_argument("--results", type=Path, default=RESULTS, help="result files (default: %(default)s)")
    ap.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    args = ap.parse_args(argv)
    sources = Sources(root=args.results)
    paths = [Path(f).resolve() for f in args.files] or [ROOT / f for f in DOCS]
    errors: list[str] = []
    stale: list[str] = []
    for path in paths:
        changed, errs = process(path, sources, write=not args.check)
        errors += errs
        if changed:
            stale.append(_rel(path))
    for e in errors:
        print(e, file=sys.stderr)
    if args.check and stale:
        print(f"stale figures in {', '.join(stale)}: run `make bench-report`", file=sys.stderr)
    elif stale and not errors:
        print(f"regenerated figures in {', '.join(stale)}")
    dirty = sorted(n for n in sources.used if sources.files[n]["provenance"].get("dirty"))
    if dirty:
        print(f"note: {', '.join(dirty)} came from a tree with uncommitted changes", file=sys.stderr)
    print(f"{len(sources.used)} result files quoted, {len(errors)} errors")
    return 1 if errors or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
