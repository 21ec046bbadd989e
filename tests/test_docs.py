"""The README and the guides in docs/: what users and CI rely on in them.

CI runs README's test command (.ci/run), every figure must point at the results file that
holds its command and commit, and links must lead somewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
TEST_COMMAND = 'bash scripts/setup.sh && .venv/bin/python -m pytest -q -m "not slurm" tests'
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A commit hash: 7 to 40 hex digits with at least one letter and one digit among them.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_readme_starts_with_the_quick_start_and_ci_test_command():
    lines = README.read_text(encoding="utf-8").splitlines()
    block = lines[lines.index("```bash") + 1:][:2]
    assert block[0].startswith("bash scripts/quickstart.sh ")
    assert block[1].startswith(TEST_COMMAND + "  #")
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_is_short_and_names_no_commit():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert COMMIT.findall(text) == []


def test_every_results_figure_in_the_readme_links_its_file():
    text = README.read_text(encoding="utf-8")
    results = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in results.splitlines() if row.startswith("| ") and not row.startswith("| what")]
    assert len(rows) >= 10
    for row in rows:
        if re.search(r"\d", row):
            assert "](benchmarks/results/" in row, row


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_to_files_and_headings_that_exist(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: {target}"


def test_the_deployment_diagram_is_its_source_file():
    source = (ROOT / "docs" / "what-runs-where.mmd").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```mermaid\n(.*?)```", page, flags=re.S)
    assert blocks == [source]
