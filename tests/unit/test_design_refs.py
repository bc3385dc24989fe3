"""Every ``docs/design.md §N`` cited in the code names a section that docs/design.md has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_design_reference_resolves():
    sections = set(re.findall(r"^## §(\d+)", (REPO / "docs" / "design.md").read_text(), flags=re.M))
    assert {"2", "3", "4", "5", "7", "8"} <= sections
    cited: dict[str, set[str]] = {}
    for pkg in ("runtime", "planner", "hetu_cli", "tests", "scripts"):
        for path in (REPO / pkg).rglob("*.py"):
            text = path.read_text()
            # The brief outside the repository, named the way the code once cited it (upper case).
            assert not re.search(r"(?<!docs/)\bDESIGN\.md", text), f"{path} cites a design file the repository lacks"
            for ref in re.findall(r"docs/design\.md\s*((?:§\d+(?:,\s*)?)+)", text):
                for n in re.findall(r"§(\d+)", ref):
                    cited.setdefault(n, set()).add(str(path.relative_to(REPO)))
    assert cited, "no reference found: the pattern is broken"
    missing = {n: sorted(p) for n, p in cited.items() if n not in sections}
    assert missing == {}, f"references to sections docs/design.md does not have: {missing}"
