"""The design decisions the code cites live in the repository: every `docs/variants-spec.md §N[.M]` reference in the
code, tests, benchmarks and README names a section that exists in `docs/variants-spec.md`, and every place that cites
a DECISION finds [DECISION] notes there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "variants-spec.md"
SOURCES = [
    p
    for folder in ("hf_variants", "training", "model_cards", "benchmarks", "modeling_tests")
    for p in (ROOT / folder).rglob("*")
    if p.suffix in (".py", ".md")
] + [ROOT / "README.md"]


def test_every_cited_section_exists():
    headings = {match[1] for match in re.finditer(r"^#+ (\d+(?:\.\d+)?)[. ]", SPEC.read_text(), re.MULTILINE)}
    cited = {}
    for path in SOURCES:
        for match in re.finditer(r"docs/variants-spec\.md`? §(\d+(?:\.\d+)?)", path.read_text(encoding="utf-8")):
            cited.setdefault(match[1].rstrip("."), []).append(path.relative_to(ROOT).as_posix())
    assert len(cited) >= 5, cited  # the code does cite the spec
    missing = {section: where for section, where in cited.items() if section not in headings}
    assert not missing, missing


def test_cited_decisions_are_in_the_spec():
    decisions = SPEC.read_text().count("[DECISION]")
    citing = [p for p in SOURCES if "DECISION" in p.read_text(encoding="utf-8") and p.name != "test_docs.py"]
    assert citing and decisions >= len(citing)
    for path in citing:
        assert "docs/variants-spec.md" in path.read_text(encoding="utf-8"), path
