"""What a call returns: :class:`RankResults`, ``{rank: value}`` printed compactly,
and :class:`Lost`, the entry of a rank the group went on without.

Below the controller (which builds one per finished call) and the public
API (which returns it), so neither imports the other for it.

Non-goals: errors (errors.py), waiting (futures.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rankspans import format_ranks


@dataclass(frozen=True)
class Lost:
    """The entry of a rank the group went on without (an elastic world size,
    ``min_ranks``): the call ran on the ranks left and this one is lost,
    ``reason`` saying why. Not an exception: the survivors' values are the
    call's result. False in a boolean test."""

    rank: int
    reason: str

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<rank {self.rank} lost: {self.reason}>"


class RankResults(dict):
    """``{rank: value}`` of one call, printed compactly: ranks that returned
    equal values are shown once."""

    def _groups(self) -> list[tuple[list[int], Any]]:
        groups: list[tuple[list[int], Any]] = []
        for rank in sorted(self):
            value = self[rank]
            for ranks, v in groups:
                try:
                    same = type(v) is type(value) and bool(v == value)
                except Exception:
                    same = False
                if same:
                    ranks.append(rank)
                    break
            else:
                groups.append(([rank], value))
        return groups

    def __repr__(self) -> str:
        if not self:
            return "RankResults({})"
        groups = self._groups()
        if len(groups) == len(self):
            return "RankResults({" + ", ".join(f"{r}: {self[r]!r}" for r in sorted(self)) + "})"
        parts = [f"ranks {format_ranks(rs)}: {v!r}" if len(rs) > 1 else f"rank {rs[0]}: {v!r}"
                 for rs, v in groups]
        return "RankResults(" + "; ".join(parts) + ")"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def values_list(self) -> list[Any]:
        """Values in rank order (a lost rank's is its :class:`Lost` entry)."""
        return [self[r] for r in sorted(self)]

    @property
    def lost(self) -> tuple[int, ...]:
        """The ranks whose entry says they are lost (the group went on
        without them: ``min_ranks``)."""
        return tuple(r for r in sorted(self) if isinstance(self[r], Lost))

    def survivors(self) -> RankResults:
        """The entries of the ranks that ran the call (every one but the lost)."""
        return RankResults({r: v for r, v in self.items() if not isinstance(v, Lost)})
