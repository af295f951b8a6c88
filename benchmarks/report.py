"""`benchmarks/RESULTS.md` keeps hand-written analysis around generated tables: each script rewrites only its own
section, between `<!-- name:start -->` and `<!-- name:end -->`."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, text: str, path: Path = RESULTS_MD) -> bool:
    """Replace section `name` of RESULTS.md with `text`; False (file untouched) when the file or markers are
    missing."""
    if not path.is_file():
        return False
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    content = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(content):
        return False
    path.write_text(pattern.sub(lambda _: f"{start}\n{text.rstrip()}\n{end}", content, count=1))
    return True
