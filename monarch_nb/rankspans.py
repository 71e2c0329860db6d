"""Rank lists as compact text: ``[0, 1, 2, 5]`` -> ``"0-2,5"``.

The bottom of the shared base: errors.py (messages) and selection.py (which
also parses such text) both use it, and it imports nothing of monarch_nb.
"""

from __future__ import annotations

from collections.abc import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """Format ranks compactly: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    nums = sorted({int(r) for r in ranks})
    if not nums:
        return "none"
    parts: list[str] = []
    start = prev = nums[0]
    for r in nums[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(span(start, prev))
        start = prev = r
    parts.append(span(start, prev))
    return ",".join(parts)


def span(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    if hi == lo + 1:
        return f"{lo},{hi}"
    return f"{lo}-{hi}"


__all__ = ["format_ranks", "span"]
