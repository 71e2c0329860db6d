#!/usr/bin/env python3
"""Check that every relative link in the Markdown resolves to a file.

Covers README.md, CHANGELOG.md and docs/**/*.md (``make docs`` runs it after
the Sphinx build, which already fails on a link to a missing page or anchor
inside the site). External addresses are not fetched (CI has no internet);
``#anchor``-only links are left to Sphinx. Exit 1 with one line per broken link.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def links(path: Path) -> list[tuple[int, str]]:
    found, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        found += [(n, m.group(1)) for m in LINK.finditer(line)]
    return found


def main() -> int:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    bad = []
    checked = 0
    for f in files:
        for n, target in links(f):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            checked += 1
            rel = target.split("#", 1)[0]
            if not (f.parent / rel).exists():
                bad.append(f"{f.relative_to(ROOT)}:{n}: link to {target!r}: no such file")
    for line in bad:
        print(line)
    print(f"check_doc_links: {checked} relative links in {len(files)} files, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
