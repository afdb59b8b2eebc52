"""benchmarks/report.py: figures in the docs are rendered from result files, and nothing else passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report

PROV = {"commit": "abc", "dirty": False, "machine_us": 140.0}


@pytest.fixture
def sources(tmp_path: Path) -> report.Sources:
    results = tmp_path / "results"
    results.mkdir()
    data = {"provenance": PROV, "act": {"fast": 4.236, "pod": 7.79}, "gpus": [8, None], "rows": [1.5, 2.5]}
    (results / "sim.json").write_text(json.dumps(data))
    (results / "old.json").write_text(json.dumps({"act": 1.0}))
    return report.Sources(root=results)


def region(template: str, body: str = "stale") -> str:
    return f"intro\n<!-- bench:begin\n{template}\n-->\n{body}\n<!-- bench:end -->\nafter\n"


def test_a_region_is_rendered_from_its_template(tmp_path: Path, sources: report.Sources) -> None:
    """Given a region with value, expression, condition and input placeholders, when written,
    then its body holds the rendered figures and the template is kept."""
    md = tmp_path / "a.md"
    template = (
        "fast {{sim:act/fast|.2f}} s, {{= [sim:act/pod] / [sim:act/fast] |.2f}}x, "
        "{{? [sim:act/fast] < 5 |met|not met}} (target {{!5 s}}), GPUs {{sim:gpus/1|d|not reached}}"
    )
    md.write_text(region(template))
    changed, errors = report.process(md, sources, write=True)
    assert (changed, errors) == (True, [])
    text = md.read_text()
    assert "-->\nfast 4.24 s, 1.84x, met (target 5 s), GPUs not reached\n<!-- bench:end -->" in text
    assert template in text
    assert report.process(md, sources, write=False) == (False, [])


def test_a_figure_outside_a_region_has_no_source(tmp_path: Path, sources: report.Sources) -> None:
    """Given prose quoting 1.84x and a table cell 2.37, when checked, then both are errors with
    their line; the same figures in code, or in an inputs region, pass."""
    md = tmp_path / "a.md"
    md.write_text(
        "Fast is 1.84x better.\n| a | 2.37 |\n`4.2 s` in code\n```\n3.1 ms\n```\n"
        "<!-- bench:inputs: parameters -->\nthink time 8 s\n<!-- bench:end -->\nbatch 1280 on 15 nodes\n"
    )
    _, errors = report.process(md, sources, write=False)
    assert [e.split(": ")[0:2] for e in errors] == [
        [f"{md}:1", "'1.84x' has no source"],
        [f"{md}:2", "'2.37' has no source"],
    ]


def test_a_literal_figure_in_a_template_is_refused(tmp_path: Path, sources: report.Sources) -> None:
    """Given a template writing 4.24 s by hand, when processed, then it is refused and the file
    is not written."""
    md = tmp_path / "a.md"
    md.write_text(region("fast 4.24 s"))
    changed, errors = report.process(md, sources, write=True)
    assert changed and len(errors) == 1 and "written literally" in errors[0]
    assert "stale" in md.read_text()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{old:act|.2f}}", "has no provenance"),
        ("{{sim:act/slow}}", "has no 'act/slow'"),
        ("{{none:x}}", "no result file"),
        ("{{sim:gpus/1|d}}", "is null"),
        ("{{= __import__('os') }}", "only numbers"),
    ],
)
def test_a_placeholder_without_a_sound_source_fails(
    tmp_path: Path, sources: report.Sources, template: str, message: str
) -> None:
    """Given a placeholder naming a file without provenance, a missing key or file, a null
    without a text for it, or code, when rendered, then it fails saying why."""
    md = tmp_path / "a.md"
    md.write_text(region(template))
    _, errors = report.process(md, sources, write=True)
    assert len(errors) == 1 and message in errors[0]


def test_check_mode_reports_a_stale_region(tmp_path: Path, sources: report.Sources) -> None:
    """Given a region whose body is out of date, when run with --check, then it fails and leaves
    the file alone; without --check it rewrites it and then passes."""
    md = tmp_path / "a.md"
    md.write_text(region("{{sim:act/fast|.1f}} s"))
    results = ["--results", str(sources.root)]
    assert report.main(["--check", *results, str(md)]) == 1
    assert "stale" in md.read_text()
    assert report.main([*results, str(md)]) == 0
    assert report.main(["--check", *results, str(md)]) == 0
    assert "-->\n4.2 s\n" in md.read_text()


def test_every_figure_in_the_readme_and_docs_comes_from_a_result_file() -> None:
    """Given the repository's README.md and docs/*.md, when checked, then every figure is rendered
    from a committed result file and up to date (run `make bench-report` after a benchmark)."""
    assert report.main(["--check"]) == 0
