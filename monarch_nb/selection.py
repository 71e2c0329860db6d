"""Rank selection specs (``3``, ``0,2``, ``1-3``, ``::2``, ``all``) — pure.

Parses what users type after ``--ranks`` into a sorted tuple of rank numbers,
and formats rank lists back into the same compact language for messages.
Non-goals: knowing which ranks are alive (the controller decides that).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import UsageError
from .rankspans import format_ranks
from .rankspans import span as _span


class SpecError(UsageError):
    """A rank spec that cannot be parsed or names ranks outside the mesh."""


def parse_ranks(spec: str | int | Iterable[int] | slice | None, world_size: int) -> tuple[int, ...]:
    """Return the sorted, de-duplicated ranks that ``spec`` selects.

    ``None`` and ``"all"`` select every rank. Python slices and iterables of
    ints are accepted too so that the Python API and the magics share one
    grammar. Raises :class:`SpecError` with a message that says what is valid.
    """
    if world_size <= 0:
        raise SpecError("the mesh has no ranks")
    if spec is None:
        return tuple(range(world_size))
    if isinstance(spec, bool):
        raise SpecError(f"rank spec {spec!r} is not valid; {_HELP}")
    if isinstance(spec, int):
        return _check((spec,), world_size, str(spec))
    if isinstance(spec, slice):
        if spec.step == 0:
            raise SpecError(f"rank spec {spec!r}: a step of 0 selects nothing; {_HELP}")
        try:
            chosen_by_slice = tuple(range(world_size))[spec]
        except TypeError:  # slice("a"), slice(0, 1.5): not rank numbers
            raise SpecError(f"rank spec {spec!r} is not valid; {_HELP}") from None
        return _check(chosen_by_slice, world_size, repr(spec), allow_empty=False)
    if not isinstance(spec, str):
        try:
            listed = tuple(int(r) for r in spec)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
            raise SpecError(f"rank spec {spec!r} is not valid; {_HELP}") from None
        return _check(listed, world_size, repr(spec))

    text = spec.strip()
    if text.lower() in ("all", "*", ""):
        if not text:
            raise SpecError(f"empty rank spec; {_HELP}")
        return tuple(range(world_size))
    chosen: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise SpecError(f"rank spec {spec!r} has an empty item; {_HELP}")
        chosen.extend(_parse_part(part, world_size, spec))
    return _check(tuple(chosen), world_size, spec)


_HELP = "use a rank (3), a list (0,2), a range (1-3), a step (::2) or all"


def _parse_part(part: str, world_size: int, spec: str) -> list[int]:
    try:
        if ":" in part:
            pieces = part.split(":")
            if len(pieces) > 3:
                raise ValueError
            nums = [int(p) if p.strip() else None for p in pieces]
            if len(nums) == 3 and nums[2] == 0:
                raise SpecError(f"rank spec {spec!r}: a step of 0 selects nothing; {_HELP}")
            return list(range(world_size))[slice(*nums)]
        if "-" in part[1:]:
            lo_s, hi_s = part.split("-", 1) if not part.startswith("-") else ("", "")
            lo, hi = int(lo_s), int(hi_s)
            if hi < lo:
                raise SpecError(f"rank spec {spec!r}: range {part} runs backwards; write {hi}-{lo}")
            if lo < 0 or hi >= world_size:
                # say which ranks are missing without listing them: "0-99999999999"
                # must not build a list of a hundred billion ranks first
                bad = [(a, b) for a, b in ((lo, min(hi, -1)), (max(lo, world_size), hi)) if a <= b]
                raise SpecError(_missing(",".join(_span(a, b) for a, b in bad), world_size))
            return list(range(lo, hi + 1))
        return [int(part)]
    except SpecError:
        raise
    except ValueError:
        raise SpecError(f"rank spec {spec!r} is not valid; {_HELP}") from None


def _check(ranks: tuple[int, ...], world_size: int, spec: str, allow_empty: bool = False) -> tuple[int, ...]:
    bad = sorted({r for r in ranks if r < 0 or r >= world_size})
    if bad:
        raise SpecError(_missing(format_ranks(bad), world_size))
    out = tuple(sorted(set(ranks)))
    if not out and not allow_empty:
        raise SpecError(f"rank spec {spec} selects no rank; {_HELP}")
    return out


def _missing(ranks: str, world_size: int) -> str:
    return (f"rank {ranks} does not exist: this mesh has ranks 0-{world_size - 1}"
            if world_size > 1 else f"rank {ranks} does not exist: this mesh has only rank 0")
