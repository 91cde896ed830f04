"""Every link in README.md leads somewhere: a relative path names a file of the repository, and an anchor
(`#section`, `docs/testing.md#section`) names a heading of that page, slugged as GitHub slugs headings. Two links
into docs/testing.md pointed at headings renamed when the tests moved into subject directories."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no headings in code blocks
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


def test_slug_of_a_heading_with_code_and_punctuation():
    families = "Model families (`tests/checkpoint/test_families.py`)"
    assert slug(families) == "model-families-testscheckpointtest_familiespy"
    align = "`plate-inspect align`: weight vs. activation geometry"
    assert slug(align) == "plate-inspect-align-weight-vs-activation-geometry"


def test_every_readme_link_resolves():
    readme = ROOT / "README.md"
    broken = []
    for target in LINK.findall(readme.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else readme
        if not page.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor} in {page.relative_to(ROOT)}")
    assert broken == []
