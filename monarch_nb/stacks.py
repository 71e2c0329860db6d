"""Grouped stacks of a mesh: what ``mesh.stacks()`` returns and how the hang
watchdog explains a stuck call. Pure data and text, no sockets.

Each rank answers with its threads' frames (debug.snapshot, outermost first).
Ranks whose main threads stand in the same place are shown once, with their
rank list; a one-line summary per group names the collective a rank waits
in (any frame inside ``torch/distributed``) and the innermost user frame
(a cell line, or the user's function), which is what one looks for first:

    ranks 0,1,3: in all_reduce (collective), from waiting_for_peer (<mnb-cell-5> line 5)
    rank 2: in stuck_here (<mnb-cell-5> line 7): time.sleep(3600)

Non-goals: taking the stacks (debug.py on the rank), transport (controller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .selection import format_ranks

# Wrappers torch puts around collectives: not the collective's name.
_WRAPPERS = {"wrapper", "_wrapper", "inner", "_fn", "wrapped", "__call__"}


@dataclass
class RankStacks:
    """One rank's answer. ``status`` is ``ok``, ``no answer`` (frozen, or
    its control thread is blocked) or the rank's state when it could not be
    asked (``dead``, ``respawning``...)."""

    rank: int
    status: str = "ok"
    threads: list[dict[str, Any]] = field(default_factory=list)
    busy: int = 0  # the call the main thread runs, 0 when idle
    native: str = ""  # py-spy's dump, when asked for and available
    flight: dict[str, Any] | None = None  # its flight recorder's tail, when asked for

    @property
    def main(self) -> list[list[Any]]:
        for t in self.threads:
            if t.get("main"):
                return [list(f) for f in t.get("frames", [])]
        return []

    def collective(self) -> str | None:
        """The torch.distributed call the main thread waits in, if any."""
        for filename, _line, func, _src in self.main:
            path = str(filename).replace("\\", "/")
            if "torch/distributed/" in path and func not in _WRAPPERS:
                return str(func)
            if func == "_free_group" and path.endswith("monarch_nb/backends.py"):
                # leaving the old group: its destructor waits for a collective
                return "destroy_process_group"
        return None

    def user_frame(self) -> list[Any] | None:
        """The innermost frame of the user's own code."""
        for frame in reversed(self.main):
            if _is_user(str(frame[0])):
                return frame
        return None

    def where(self) -> str:
        if self.status != "ok":
            return self.status
        if not self.main:
            return "idle (no call running)" if not self.busy else "running, no Python frame"
        coll = self.collective()
        user = self.user_frame()
        at = f"{user[2]} ({short_path(user[0])} line {user[1]})" if user else ""
        if coll:
            return f"in {coll} (collective)" + (f", from {at}" if at else "")
        inner = self.main[-1]
        text = f"in {at}" if user else f"in {inner[2]} ({short_path(inner[0])} line {inner[1]})"
        src = (user or inner)[3]
        return text + (f": {src}" if src else "")


def _is_user(filename: str) -> bool:
    if filename.startswith("<mnb-cell") or filename.startswith("<setup"):
        return True
    if filename.startswith("<"):
        return False
    return not any(part in filename for part in ("site-packages", "dist-packages", "/lib/python3"))


def short_path(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        i = filename.find(marker)
        if i >= 0:
            return filename[i + len(marker):]
    return filename


def _key(frames: list[list[Any]]) -> tuple[Any, ...]:
    return tuple((f[0], f[1], f[2]) for f in frames)


class Stacks(dict[int, RankStacks]):
    """``mesh.stacks()``: rank -> :class:`RankStacks`, printed grouped.
    ``collectives``: what the ranks' flight recorders say is wrong, one line
    per finding (controller/analysis/collectives.py); printed first."""

    collectives: tuple[str, ...] | list[str] = ()  # (class default; set per instance)
    # the persisted flight records of incarnations that died in the call
    # (controller/inspector.py: Inspector.dead_tails), read with the live ones
    dead: tuple[Any, ...] | list[Any] = ()  # (class default; set per instance)

    def groups(self) -> list[tuple[list[int], RankStacks]]:
        """Ranks whose main threads stand in the same place, with one
        representative; the largest group first."""
        by_key: dict[tuple[Any, ...], list[int]] = {}
        for rank in sorted(self):
            st = self[rank]
            key = (st.status, bool(st.busy) if not st.main else None, _key(st.main))
            by_key.setdefault(key, []).append(rank)
        groups = [(ranks, self[ranks[0]]) for ranks in by_key.values()]
        groups.sort(key=lambda g: (-len(g[0]), g[0][0]))
        return groups

    def summary(self) -> list[str]:
        return [f"{_label(ranks)}: {st.where()}" for ranks, st in self.groups()]

    def hint(self) -> str:
        """What the grouping suggests, for the hang watchdog."""
        answered = {r: s for r, s in self.items() if s.status == "ok"}
        silent = sorted(r for r, s in self.items() if s.status != "ok")
        in_coll: dict[str, list[int]] = {}
        outside: list[int] = []
        for r, s in sorted(answered.items()):
            c = s.collective()
            if c:
                in_coll.setdefault(c, []).append(r)
            elif s.busy:
                outside.append(r)
        parts = []
        if in_coll and outside:
            waiting = sorted(r for rs in in_coll.values() for r in rs)
            names = ", ".join(sorted(in_coll))
            parts.append(
                f"{_label(waiting)} wait in a collective ({names}) that {_label(outside)} "
                f"{'has' if len(outside) == 1 else 'have'} not reached: a collective finishes "
                "only when every rank of the group calls it")
        elif len(in_coll) > 1:
            desc = "; ".join(f"{c} on {_label(rs)}" for c, rs in sorted(in_coll.items()))
            parts.append(f"the ranks are in different collectives ({desc}): every rank must "
                         "call the same collectives in the same order")
        elif in_coll:
            parts.append("every rank that answered is in the same collective: a peer may be "
                         "missing from the group, or the transport is stuck")
        elif answered:
            parts.append("no rank is in a collective: the call is computing or waiting on "
                         "something else (see where each rank is)")
        if silent:
            parts.append(f"{_label(silent)} did not answer ({self[silent[0]].status})")
        return "; ".join(parts)

    def render(self, all_threads: bool = True) -> str:
        out: list[str] = []
        if self.collectives:
            out.append("collectives (flight recorder):")
            out.extend(f"  {line}" for line in self.collectives)
        for ranks, st in self.groups():
            out.append(f"{_label(ranks)}: {st.where()}")
            for f in st.main:
                out.append(f"    {short_path(str(f[0]))} line {f[1]} in {f[2]}")
                if f[3]:
                    out.append(f"        {f[3]}")
            if st.native:
                out.append("    native (py-spy):")
                out.extend("      " + line for line in st.native.rstrip().splitlines())
        if all_threads:
            others: dict[tuple[Any, ...], list[tuple[int, dict[str, Any]]]] = {}
            for rank in sorted(self):
                for t in self[rank].threads:
                    if not t.get("main"):
                        frames = [list(f) for f in t.get("frames", [])]
                        others.setdefault((t.get("name"), _key(frames)), []).append((rank, t))
            if others:
                out.append("other threads:")
            for (name, _), members in others.items():
                ranks = [r for r, _ in members]
                frames = members[0][1].get("frames", [])
                last = frames[-1] if frames else None
                where = f"{last[2]} ({short_path(str(last[0]))} line {last[1]})" if last else "?"
                out.append(f"  {_label(ranks)} thread {name!r}: in {where}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return self.render()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.render())


def _label(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


def hang_report(stacks: Stacks, seconds: float) -> str:
    """The watchdog's note: printed once into the running cell."""
    head = (f"monarch_nb: no progress for {seconds:g} s (no output, metric or result); "
            "where the ranks are:")
    hint = stacks.hint()
    tail = f"hint: {hint}" if hint else ""
    return "\n".join(x for x in (head, stacks.render(all_threads=False), tail) if x)
