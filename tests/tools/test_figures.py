"""tools/figures.py: the documents' tables of figures agree with the committed data they are
rendered from (no benchmark runs here), and the rendering itself: median and min-max of a
measurement's runs, the markers, the check's verdicts, a measurement recorded from a command."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent.parent
TOOL = REPOSITORY / "tools" / "figures.py"


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_document_agrees_with_its_data(figures):
    """README.md, operator/README.md and docs/**/*.md: every table between figures markers is
    what its data renders (after changing either, run `python tools/figures.py write`)."""
    documents = figures.documents()
    assert REPOSITORY / "README.md" in documents
    assert REPOSITORY / "operator" / "README.md" in documents
    assert figures.check(documents) == []


def test_the_readme_has_its_gpu_and_cpu_tables(figures):
    names = [block.name for block in figures.blocks((REPOSITORY / "README.md").read_text())]
    assert any(name.startswith("gpu-check/") for name in names)
    assert [name for name in names if not name.startswith("gpu-check/")]


def test_every_measurement_file_is_rendered_somewhere(figures):
    """A data file nobody shows is a figure the documents lost track of."""
    shown = {block.name for path in figures.documents() for block in figures.blocks(path.read_text())}
    for path in sorted(figures.MEASUREMENTS.glob("*.json")):
        assert path.stem in shown, f"{path.name} is in no document's table"


def measurement(runs: list[dict[str, float]], **fields) -> dict:
    data = {
        "schema": 1,
        "name": "example",
        "command": "berth bench example .cache/tiny-model",
        "setup": None,
        "note": None,
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "uncommitted": [],
        "date": "2026-12-07T12:00:00+00:00",
        "machine": {
            "cpu_model": "AMD EPYC",
            "cpu_family": "26",
            "cpu_model_number": "2",
            "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False},
            "cores": 2,
            "memory_bytes": 24 * 2**30,
        },
        "software": {"python": "3.11.7"},
        "environment": {},
        "metrics": [
            {"key": "ratio", "label": "shape / baseline", "unit": "x", "pattern": "ratio ([0-9.]+)x"},
            {"key": "tokens", "label": "output throughput", "unit": "tok/s", "pattern": "([0-9.]+) tok/s"},
        ],
        "runs": [
            {
                "started": "2026-12-07T12:00:00+00:00",
                "seconds": 1.0,
                "exit_code": 0,
                "load_average": [1.5 + index, 1.0, 1.0],
                "metrics": values,
                "output": "",
            }
            for index, values in enumerate(runs)
        ],
    }
    data.update(fields)
    return data


@pytest.fixture
def workspace(figures, tmp_path, monkeypatch):
    folder = tmp_path / "measurements"
    folder.mkdir()
    monkeypatch.setattr(figures, "MEASUREMENTS", folder)
    document = tmp_path / "doc.md"
    document.write_text("Before.\n\n<!-- figures:example -->\n<!-- /figures:example -->\n\nAfter.\n")
    return folder, document


def write_measurement(folder: Path, data: dict) -> None:
    (folder / "example.json").write_text(json.dumps(data))


def test_a_table_is_the_median_and_range_of_the_runs(figures, workspace):
    folder, document = workspace
    runs = [
        {"ratio": 1.10, "tokens": 1200.0},
        {"ratio": 0.90, "tokens": 1500.0},
        {"ratio": 1.30, "tokens": 900.0},
    ]
    write_measurement(folder, measurement(runs))
    assert figures.check([document]) == [f"{document}: figures:example differs from what its data renders"]

    assert figures.write([document]) == [document]
    text = document.read_text()
    assert "| shape / baseline | 1.10x | 0.90x–1.30x |" in text
    assert "| output throughput | 1,200 tok/s | 900 tok/s–1,500 tok/s |" in text
    assert "the median of 3 runs" in text
    assert "`berth bench example .cache/tiny-model`" in text
    assert "AMD EPYC (family 26) with AVX2, AVX-512F, AVX-512 BF16, no AMX BF16; 2 cores, 24.0 GiB" in text
    assert "commit `012345678`" in text
    assert "load average 1.5-3.5" in text
    assert text.startswith("Before.\n\n<!-- figures:example -->\n") and text.endswith(
        "<!-- /figures:example -->\n\nAfter.\n"
    )
    assert figures.check([document]) == []
    assert figures.main(["--check", str(document)]) == 0

    # A figure edited by hand, or data changed without `write`: the check says which table.
    document.write_text(text.replace("| 1.10x |", "| 1.20x |"))
    assert figures.check([document]) == [f"{document}: figures:example differs from what its data renders"]
    assert figures.main(["--check", str(document)]) == 1
    document.write_text(text)
    runs[0]["ratio"] = 1.2
    write_measurement(folder, measurement(runs))
    assert figures.main(["check", str(document)]) == 1


def test_uncommitted_changes_are_named(figures, workspace):
    folder, document = workspace
    runs = [{"ratio": 1.0, "tokens": 1.0}] * 3
    write_measurement(folder, measurement(runs, uncommitted=[" M engine/llm.py"]))
    figures.write([document])
    assert "with 1 files changed in the working tree" in document.read_text()


def test_fewer_than_three_runs_are_no_figure(figures, workspace):
    folder, document = workspace
    write_measurement(folder, measurement([{"ratio": 1.0, "tokens": 1.0}] * 2))
    problems = figures.check([document])
    assert len(problems) == 1 and "2 runs; a figure needs at least 3" in problems[0]


def test_missing_data_and_broken_markers_are_reported(figures, workspace):
    _, document = workspace
    assert "no such data file" in figures.check([document])[0]
    document.write_text("<!-- figures:example -->\nno closing marker\n")
    assert figures.check([document]) == [f"{document}: figures:example has no matching pair of markers"]


def test_markers_quoted_in_code_are_examples(figures, tmp_path):
    document = tmp_path / "doc.md"
    document.write_text(
        "Tables sit between `<!-- figures:NAME -->` markers:\n\n```markdown\n"
        "<!-- figures:NAME -->\n(generated)\n<!-- /figures:NAME -->\n```\n"
    )
    assert figures.blocks(document.read_text()) == []
    assert figures.check([document]) == []


def test_a_gpu_report_says_what_it_cannot_vouch_for(figures, tmp_path):
    """One run, no spread; the commit before the run; the engine commits since, counted up to the
    commit stamped in the marker, so the table stays put as commits land."""
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- figures:gpu-check/h200-2026-12-04 -->\n<!-- /figures:gpu-check/h200-2026-12-04 -->\n"
    )
    assert "no as-of=COMMIT" in figures.check([document])[0]
    figures.write([document])
    text = document.read_text()
    head = figures.git("rev-parse", "HEAD")
    assert f"<!-- figures:gpu-check/h200-2026-12-04 as-of={head[:12]} -->" in text
    assert "**The CUDA path at HEAD is unverified**" in text
    assert "one run" in text and "no spread" in text
    report = json.loads((figures.GPU_REPORTS / "h200-2026-12-04.json").read_text())
    eager = next(row for row in report["checks"][3]["rows"] if row["item"] == "berth batch-1 TPOT, eager")
    assert f"| decode | berth batch-1 TPOT, eager | {eager['value']} |" in text
    assert figures.check([document]) == []


def test_a_measurement_is_recorded_from_its_command(figures, tmp_path, monkeypatch):
    """Three runs of a command, each figure read from its output, and what the file must say."""
    monkeypatch.setattr(figures, "MEASUREMENTS", tmp_path)
    counter = tmp_path / "count"
    script = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
        "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
        "print('progress\\rdone'); print(f'ratio {[1.0, 3.0, 2.0][n - 1]:.2f}x')"
    )
    metric = figures.Metric("ratio", "shape / baseline", "x", r"ratio ([0-9.]+)x")
    path = figures.record(
        "recorded", [sys.executable, "-c", script, str(counter)], [metric], runs=3, progress=lambda line: None
    )
    data = json.loads(path.read_text())
    assert [run["metrics"]["ratio"] for run in data["runs"]] == [1.0, 3.0, 2.0]
    assert data["commit"] == figures.git("rev-parse", "HEAD")
    assert set(data["machine"]) >= {"cpu_model", "flags", "cores", "memory_bytes"}
    assert set(data["machine"]["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert data["machine"]["cores"] >= 1 and data["machine"]["memory_bytes"] > 0
    assert data["runs"][0]["output"].startswith("done\n")  # a progress bar's redraws keep their end
    assert data["date"] and data["command"].startswith(sys.executable)

    with pytest.raises(figures.FiguresError, match="at least 3"):
        figures.record("few", [sys.executable, "-c", "pass"], [metric], runs=2)
    with pytest.raises(figures.FiguresError, match="matches nothing"):
        figures.record("silent", [sys.executable, "-c", "pass"], [metric], runs=3, progress=lambda line: None)
    with pytest.raises(figures.FiguresError, match="exited 3"):
        figures.record(
            "failing", [sys.executable, "-c", "exit(3)"], [metric], runs=3, progress=lambda line: None
        )
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["recorded.json"]
