"""Render the Kubernetes manifests in `k8s/` with a few values (docs/kubernetes.md).

    python -m tangram_celery.deploy.k8s render --set image=registry.example/tangram:0.1 -o out/
    kubectl apply -f out/

`k8s/values.yaml` lists every value with its default; `k8s/templates/*.yaml` use them as
`{{ name }}`. The renderer is the standard library and PyYAML only: each placeholder is replaced
by its value (a value on a line of its own keeps that line's indentation on every line, which
is how the CPU worker's security context comes in from `k8s/fragments/`), a name that is not a
value is an error, and every rendered file must parse as YAML.

Files are numbered so that `kubectl apply -f DIR` creates the namespace first. The Secret with
placeholders goes to `DIR/examples/secret.yaml`, which `kubectl apply -f DIR` does not read:
the real one is created with kubectl.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

SOURCE = Path(__file__).resolve().parents[2] / "k8s"
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# output name -> template; the namespace first, the ScaledObjects (KEDA's CRD) last
LAYOUT = (
    ("00-namespace.yaml", "namespace.yaml"),
    ("10-configmap.yaml", "configmap.yaml"),
    ("20-redis.yaml", "redis.yaml"),
    ("30-scheduler.yaml", "scheduler.yaml"),
    ("31-http.yaml", "http.yaml"),
    ("32-flower.yaml", "flower.yaml"),
    ("40-worker-cpu.yaml", "worker-cpu.yaml"),
    ("41-worker-gpu.yaml", "worker-gpu.yaml"),
    ("42-worker-api.yaml", "worker-api.yaml"),
    ("50-keda.yaml", "keda.yaml"),
    ("examples/secret.yaml", "secret.yaml"),
)
CHOICES = {"redis": ("in-cluster", "external"), "sandbox_cgroups": ("host", "off")}
# a value goes into YAML as it is: no spaces, quotes, comments or flow punctuation but ${VAR}
SAFE = re.compile(r"^[A-Za-z0-9_./:@=+-]*(\$\{[A-Z0-9_]+\}[A-Za-z0-9_./:@=+-]*)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
BOUNDS = (("cpu_min", "cpu_max"), ("gpu_min", "gpu_max"), ("api_min", "api_max"))


class RenderError(ValueError):
    pass


def defaults(source: Path = SOURCE) -> dict[str, Any]:
    if not (source / "values.yaml").is_file():
        raise RenderError(f"no k8s/values.yaml under {source}: run from a checkout or pass --source")
    data = yaml.safe_load((source / "values.yaml").read_text())
    if not isinstance(data, dict):
        raise RenderError(f"{source / 'values.yaml'}: not a mapping")
    return data


def resolve(overrides: dict[str, str], source: Path = SOURCE) -> dict[str, Any]:
    """The defaults with `overrides` (name -> text) applied and checked."""
    values = defaults(source)
    for name, text in overrides.items():
        if name not in values:
            raise RenderError(f"unknown value {name!r}; the values are: {', '.join(sorted(values))}")
        if isinstance(values[name], int):
            try:
                values[name] = int(text)
            except ValueError:
                raise RenderError(f"{name} takes an integer, got {text!r}") from None
        else:
            values[name] = text
    check(values)
    return values


def check(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if isinstance(value, int):
            if value < 0:
                raise RenderError(f"{name} must be >= 0, got {value}")
        elif not isinstance(value, str) or not value or not SAFE.match(value):
            raise RenderError(f"{name}: {value!r} is not a plain value (no spaces, quotes or '#')")
    for name, options in CHOICES.items():
        if values[name] not in options:
            raise RenderError(f"{name} is one of {', '.join(options)}, got {values[name]!r}")
    for name in ("namespace", "secret"):
        if not DNS_LABEL.match(values[name]):
            raise RenderError(f"{name} must be a DNS label (a-z, 0-9, '-'), got {values[name]!r}")
    for lo, hi in BOUNDS:
        if values[lo] > values[hi] or values[hi] < 1:
            raise RenderError(f"{lo} ({values[lo]}) > {hi} ({values[hi]}), or {hi} < 1")
    for name in ("cpu_cores", "gpus_per_worker", "api_concurrency", "drain_grace_s"):
        if values[name] < 1:
            raise RenderError(f"{name} must be >= 1")


def substitute(text: str, values: dict[str, Any], where: str) -> str:
    """Each {{ name }} replaced by its value; a multi-line value alone on its line is indented."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        m = PLACEHOLDER.search(line)
        if m and line.strip() == m.group(0) and m.group(1) in values:
            indent = line[: m.start()]
            block = str(values[m.group(1)]).rstrip("\n").splitlines()
            out.extend(f"{indent}{b}".rstrip() + "\n" for b in block)
            continue

        def one(m: re.Match[str]) -> str:
            if m.group(1) not in values:
                raise RenderError(f"{where}: unknown placeholder {m.group(0)}")
            return str(values[m.group(1)])

        out.append(PLACEHOLDER.sub(one, line))
    return "".join(out)


def render(values: dict[str, Any], source: Path = SOURCE) -> dict[str, str]:
    """{output path: text} for `values` (as `resolve` returns them)."""
    full = dict(values)
    full["cpu_security"] = (
        source / "fragments" / f"cpu-security-{values['sandbox_cgroups']}.yaml"
    ).read_text()
    out = {}
    for name, template in LAYOUT:
        if template == "redis.yaml" and values["redis"] != "in-cluster":
            continue
        text = substitute((source / "templates" / template).read_text(), full, template)
        try:
            list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            raise RenderError(f"{template}: the rendered text is not valid YAML: {e}") from None
        out[name] = text
    return out


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of the rendered files, in order."""
    return [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]


def write(rendered: dict[str, str], out_dir: Path) -> None:
    for name, text in rendered.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _parse_sets(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise RenderError(f"--set takes NAME=VALUE, got {item!r}")
        out[name.strip()] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tangram_celery.deploy.k8s", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="render the manifests")
    r.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a value")
    r.add_argument("-o", "--out", type=Path, help="write the files here (default: all to stdout)")
    r.add_argument("--source", type=Path, default=SOURCE, help="the k8s/ folder (default: the checkout's)")
    v = sub.add_parser("values", help="print the values and their defaults (k8s/values.yaml explains them)")
    v.add_argument("--source", type=Path, default=SOURCE, help="the k8s/ folder (default: the checkout's)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "values":
            sys.stdout.write(yaml.safe_dump(defaults(args.source), sort_keys=False))
            return 0
        rendered = render(resolve(_parse_sets(args.set), args.source), args.source)
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        # not the placeholder Secret: piped into kubectl it would overwrite the real one
        applied = {n: t for n, t in rendered.items() if not n.startswith("examples/")}
        sys.stdout.write("".join(f"---\n# {n}\n{t}" for n, t in applied.items()))
    else:
        write(rendered, args.out)
        print(f"{len(rendered)} files in {args.out} (the placeholder Secret in {args.out / 'examples'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
