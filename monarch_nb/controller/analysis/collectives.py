"""Reading the ranks' flight recorders side by side: which rank, which
collective, and why a run is slow or stuck. Pure: plain records in, a
report out; no sockets, no processes.

Each rank's recorder tail (engine/flightrec.py, decoded as
:class:`~monarch_nb.flight.OpRecord`) lists its collectives with a sequence
number per group. Lined up by that number, per group:

* **progress**: the last sequence number each member reached, and whether
  it is still in it;
* **mismatch**: the first number where the members called different
  collectives (op, dtypes and shapes, root), e.g. ``#58: ranks 0,1,3
  called all_reduce(float32[8]) from <mnb-cell-7> line 12; rank 2 called
  broadcast(float32[4]) from <mnb-cell-7> line 14``. Where they agree on the
  op but called it from different lines (an extra collective on one rank,
  paired with the next one of the others) that is reported too, when a
  collective of the group is stuck: it is the usual cause;
* **missing**: a collective some members wait in and others never entered,
  with where those are (their stack): ``ranks 0,1,3 wait in all_reduce #58;
  rank 2 never entered it: it is in stuck_here (<mnb-cell-7> line 9)``.
  On NCCL and RCCL (and for ``async_op=True``) a collective call returns
  once the op is enqueued, and the rank blocks later, at its next sync: so
  members that are past a collective others never called, while still
  running their call, are reported the same way (``ranks 0,1,3 enqueued
  all_reduce #58 ...``). A synchronous collective (gloo's) cannot be done on
  one member before every member entered it, so this never fires there.

Torch's own recorder: each rank also sends the tail of torch's flight
recorder (``torch_ops``, flight.from_torch), which sees the collectives DDP,
FSDP and other C++ callers make on the process group directly, where the
wrappers see nothing. A group whose wrapper records show nothing wrong is
lined up again on those, in torch's numbering, and what is found there is
reported with that said (``torch's recorder (DDP's and FSDP's collectives
too; its numbering): rank 0 waits in broadcast #6 ...``).

Stragglers (:func:`stragglers`): per rank, the time between its collectives
(computing) and in them (waiting), over the recent window; a rank whose
computing time is at least ``factor`` times the median of the others' is
flagged: the others wait for it in every collective.

Non-goals: asking the ranks (inspector.py), wording of one record (flight.py).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...flight import (
    DEFAULT_GROUP,
    DIED,
    IN_FLIGHT,
    OpRecord,
    decode,
    group_label,
    label,
    mismatch_text,
)
from ...stacks import RankStacks


@dataclass
class RankTail:
    """One rank's answer: its records (oldest first) and its groups' members."""

    rank: int
    ops: list[OpRecord] = field(default_factory=list)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    generation: int = 0
    total: int = 0  # records ever made (the ring keeps the newest)
    now: float = 0.0
    calls: list[list[Any]] = field(default_factory=list)  # [call, name, start, end, state]
    torch_ops: list[OpRecord] = field(default_factory=list)  # torch's own recorder's
    # set for a dead incarnation's records (flight.dead_tail): its number
    dead: int | None = None

    @classmethod
    def from_wire(cls, rank: int, data: Mapping[str, Any]) -> RankTail:
        dead = data.get("dead")
        return cls(rank, [decode(list(row)) for row in data.get("ops") or []],
                   {str(k): tuple(int(r) for r in v) for k, v in (data.get("groups") or {}).items()},
                   int(data.get("generation", 0)), int(data.get("total", 0)),
                   float(data.get("now", 0.0)), [list(c) for c in data.get("calls") or []],
                   [decode(list(row)) for row in data.get("torch_ops") or []],
                   dead if type(dead) is int else None)

    def collectives(self, generation: int | None = None) -> list[OpRecord]:
        gen = self.generation if generation is None else generation
        return [r for r in self.ops if not r.p2p and r.generation == gen]

    def torch_view(self) -> RankTail:
        """The same rank seen through torch's own recorder's records."""
        return RankTail(self.rank, list(self.torch_ops), self.groups, self.generation,
                        len(self.torch_ops), self.now)


@dataclass(frozen=True)
class Finding:
    """``kind``: ``mismatch`` (different collectives at one number),
    ``missing`` (some members never entered a collective others wait in),
    ``diverged`` (same op from different lines), ``waiting`` (every member
    is in it: a peer outside the group, or the transport), ``died`` (a rank
    died in it: its persisted records), ``p2p`` (a send/recv in flight),
    ``silent`` (ranks that did not answer)."""

    kind: str
    group: str
    seq: int | None
    text: str


@dataclass
class GroupProgress:
    group: str
    members: tuple[int, ...]
    last: dict[int, OpRecord | None]  # member -> its newest record (None: none yet)
    when: str = ""  # an earlier generation's: "before rank 2 died" (see analyze)

    def line(self) -> str:
        by: dict[tuple[Any, ...], list[int]] = {}
        for r in sorted(self.last):
            rec = self.last[r]
            key: tuple[Any, ...] = ("-",) if rec is None else (rec.seq, rec.describe(), rec.state)
            by.setdefault(key, []).append(r)
        parts = []
        for key, ranks in sorted(by.items(), key=lambda kv: kv[1][0]):
            if key == ("-",):
                parts.append(f"{label(ranks)}: none yet")
            else:
                parts.append(f"{label(ranks)}: #{key[0]} {key[1]} {key[2]}")
        when = f"{self.when}: " if self.when else ""
        return f"{when}{group_label(self.group)} ({label(self.members)}): " + "; ".join(parts)


class _Printed:
    """A report that prints as its ``render()`` (print, repr, IPython)."""

    def render(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.render()

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.render())


@dataclass(repr=False)
class CollectiveReport(_Printed):
    """``mesh.collectives()``: per group, where each rank is in its
    collectives, and what looks wrong (``findings``, most telling first)."""

    groups: list[GroupProgress] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    tails: dict[int, RankTail] = field(default_factory=dict)
    # per group, torch's own recorder's view (shown where it found something,
    # or where the wrappers recorded nothing)
    torch_groups: list[GroupProgress] = field(default_factory=list)
    silent: dict[int, str] = field(default_factory=dict)  # rank -> why it did not answer
    # the persisted records of incarnations that died in the call (RankTail.dead set)
    dead: list[RankTail] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> list[str]:
        """The findings, one line each (what the stacks and the hang
        watchdog print first)."""
        return [f.text for f in self.findings]

    def render(self) -> str:
        lines = []
        if self.findings:
            lines.append("collectives: " + ("1 finding" if len(self.findings) == 1
                                            else f"{len(self.findings)} findings"))
            lines.extend(f"  {f.text}" for f in self.findings)
        else:
            lines.append("collectives: the ranks agree (no mismatch, nothing stuck)")
        if self.groups:
            lines.append("last collective per group:")
            lines.extend(f"  {g.line()}" for g in self.groups)
        if self.torch_groups:
            lines.append(f"last collective per group in {TORCH_VIEW}:")
            lines.extend(f"  {g.line()}" for g in self.torch_groups)
        if not any(t.ops or t.torch_ops for t in [*self.tails.values(), *self.dead]):
            lines.append("  (no collective recorded yet)")
        return "\n".join(lines)


def analyze(tails: Mapping[int, RankTail], stacks: Mapping[int, RankStacks] | None = None,
            silent: Mapping[int, str] | None = None,
            dead: Iterable[RankTail] = ()) -> CollectiveReport:
    """Line the ranks' records up per group and say what disagrees.
    ``stacks`` (optional) say where a rank that never entered a collective
    is; ``silent``: ranks that did not answer, and why.

    ``dead``: the persisted records of rank incarnations that died in the
    call (flight.dead_tail, ``RankTail.dead`` set). Each says where it died
    (a ``died`` finding). A dead incarnation of the current generation
    stands for its rank where that rank did not answer (it is not back);
    one of an earlier generation (its rank was respawned and the group
    re-formed since) is lined up with the other ranks' records of *its*
    generation, so that what it disagreed on (a shape, an op) is found
    with its side named, those findings and progress lines saying
    ``before rank N died``."""
    dead = [t for t in dead if t.dead is not None]
    report = CollectiveReport(tails=dict(tails), silent=dict(silent or {}), dead=list(dead))
    if not tails and not dead:
        return report
    generation = max(t.generation for t in [*tails.values(), *dead])
    current = {r: t for r, t in tails.items() if t.generation == generation}
    stacks = dict(stacks or {})
    for t in dead:  # not back: the dead incarnation's records are the rank's last word
        if t.generation == generation and t.rank not in current:
            current[t.rank] = t
            stacks[t.rank] = RankStacks(t.rank, status=f"dead (incarnation {t.dead})")
    members: dict[str, tuple[int, ...]] = {}
    for t in current.values():
        for name, ranks in t.groups.items():
            members.setdefault(name, ranks)
    used = sorted({rec.group for t in current.values() for rec in t.collectives()},
                  key=lambda g: (len(g), g))
    for group in used:
        ranks = members.get(group) or tuple(sorted(current))
        answered = [r for r in ranks if r in current]
        per_rank = {r: {rec.seq: rec for rec in current[r].collectives() if rec.group == group}
                    for r in answered}
        last = {r: (recs[max(recs)] if recs else None) for r, recs in per_rank.items()}
        report.groups.append(GroupProgress(group, tuple(ranks), last))
        report.findings.extend(_group_findings(group, ranks, per_rank, last, stacks, current))
    report.findings.extend(_death_findings(dead))
    report.findings.extend(_p2p_findings(current))
    _torch_findings(report, current, members, stacks)
    _earlier_findings(report, tails, [t for t in dead if t.generation != generation], members,
                      stacks)
    if silent:
        quiet = sorted(silent)
        reasons = sorted(set(silent.values()))
        report.findings.append(Finding("silent", "", None, f"{label(quiet)} did not answer "
                                       f"({', '.join(reasons)})"))
    order = {"mismatch": 0, "died": 1, "missing": 2, "diverged": 3, "waiting": 4, "p2p": 5,
             "silent": 6}
    report.findings.sort(key=lambda f: order.get(f.kind, 9))
    return report


TORCH_VIEW = "torch's own recorder (DDP's and FSDP's collectives too; its numbering)"


def _torch_findings(report: CollectiveReport, current: Mapping[int, RankTail],
                    members: Mapping[str, tuple[int, ...]],
                    stacks: Mapping[int, RankStacks]) -> None:
    """Line the groups up again on torch's own records, for the groups
    where the wrappers' records found nothing wrong: a hang or a desync in
    collectives the wrappers cannot see (DDP's, FSDP's)."""
    views = {r: t.torch_view() for r, t in current.items()}
    flagged = {f.group for f in report.findings}
    shown_ours = not any(t.ops for t in current.values())
    for group in sorted({rec.group for t in views.values() for rec in t.collectives()},
                        key=lambda g: (len(g), g)):
        if group in flagged:
            continue  # the wrappers' records already tell it, with the user's lines
        ranks = members.get(group) or tuple(sorted(current))
        answered = [r for r in ranks if r in views]
        per_rank = {r: {rec.seq: rec for rec in views[r].collectives() if rec.group == group}
                    for r in answered}
        last = {r: (recs[max(recs)] if recs else None) for r, recs in per_rank.items()}
        found = _group_findings(group, ranks, per_rank, last, stacks, views)
        found = [f for f in found if f.kind != "waiting"]  # every member in it: nothing to add
        for f in found:
            report.findings.append(Finding(f.kind, f.group, f.seq, f"{TORCH_VIEW}: {f.text}"))
        if found or shown_ours:
            report.torch_groups.append(GroupProgress(group, tuple(ranks), last))


def _group_findings(group: str, ranks: tuple[int, ...], per_rank: dict[int, dict[int, OpRecord]],
                    last: dict[int, OpRecord | None], stacks: Mapping[int, RankStacks],
                    tails: Mapping[int, RankTail]) -> list[Finding]:
    out: list[Finding] = []
    common = set.intersection(*(set(s) for s in per_rank.values())) if per_rank else set()
    first_sig = first_site = None
    for seq in sorted(common):
        recs = [per_rank[r][seq] for r in per_rank]
        if first_sig is None and len({rec.signature() for rec in recs}) > 1:
            first_sig = seq
            break
        if first_site is None and len({rec.where() for rec in recs}) > 1:
            first_site = seq
    if first_sig is not None:
        recs_at = {r: per_rank[r].get(first_sig) for r in per_rank}
        out.append(Finding("mismatch", group, first_sig, mismatch_text(f"#{first_sig}", group,
                                                                       recs_at)))
    waiting = {r: rec for r, rec in last.items() if rec is not None and rec.state == IN_FLIGHT}
    if waiting:
        # the oldest collective someone waits in: those past it wait on a
        # later one only because it holds (gloo's broadcast root waits for
        # every receiver; NCCL's ops queue behind it)
        seq = min(rec.seq for rec in waiting.values())
        inside = sorted(r for r, rec in waiting.items() if rec.seq == seq)
        rec = waiting[inside[0]]
        behind = sorted(r for r in per_rank if r not in waiting
                        and (last[r] is None or last[r].seq < seq))  # type: ignore[union-attr]
        elsewhere = sorted(r for r in waiting if r not in inside)
        head = f"{label(inside)} {'waits' if len(inside) == 1 else 'wait'} in {rec.op} #{seq}"
        head += f" ({rec.where()})" if len({waiting[r].where() for r in inside}) == 1 else ""
        parts = [head]
        alike: dict[tuple[str, str], list[int]] = {}
        for r in behind:
            where = stacks[r].where() if r in stacks else "unknown"
            at = last[r]
            got = f"last was #{at.seq} {at.op}" if at is not None else ""
            alike.setdefault((where, got), []).append(r)
        for (where, got), rs in alike.items():
            one = len(rs) == 1
            before = (f"{'its' if one else 'their'} {got}" if got
                      else f"{'it' if one else 'they'} made none yet")
            parts.append(f"{label(rs)} never entered it ({before}): "
                         f"{'it is' if one else 'they are'} {_where(where)}")
        for r in elsewhere:
            other = waiting[r]
            parts.append(f"rank {r} waits in {other.op} #{other.seq} ({other.where()})")
        if behind or elsewhere:
            out.append(Finding("missing", group, seq, "; ".join(parts)))
            if first_sig is None and first_site is not None:
                recs_at = {r: per_rank[r].get(first_site) for r in per_rank}
                out.append(Finding("diverged", group, first_site,
                                   "the ranks called the same collectives from different "
                                   "lines from " + mismatch_text(f"#{first_site}", group,
                                                                 recs_at)))
        elif first_sig is None and len(inside) == len(ranks):
            out.append(Finding("waiting", group, seq, head + ": every member is in it; the "
                               "transport is stuck or a peer is slow inside it"))
    elif stacks:
        out.extend(_enqueued_findings(group, per_rank, last, stacks))
    return out


def _enqueued_findings(group: str, per_rank: dict[int, dict[int, OpRecord]],
                       last: dict[int, OpRecord | None],
                       stacks: Mapping[int, RankStacks]) -> list[Finding]:
    """Nothing in flight, yet some members are past a collective others
    never called, and those ahead still run their call: an asynchronous
    collective (NCCL, RCCL, ``async_op=True``) the others never joined."""
    reached = {r: rec.seq for r, rec in last.items() if rec is not None}
    if not reached:
        return []
    seq = max(reached.values())
    ahead = sorted(r for r, s in reached.items() if s == seq)
    behind = sorted(r for r in per_rank if r not in ahead)
    if not behind or not all(r in stacks and stacks[r].busy for r in ahead):
        return []
    rec = last[ahead[0]]
    assert rec is not None
    sites = {last[r].where() for r in ahead}  # type: ignore[union-attr]
    head = (f"{label(ahead)} enqueued {rec.op} #{seq}"
            + (f" ({rec.where()})" if len(sites) == 1 else "")
            + ", which completes only once every member calls it")
    parts = [head]
    for r in behind:
        at = last[r]
        got = f"its last was #{at.seq} {at.op}" if at is not None else "it made none yet"
        parts.append(f"rank {r} never called it ({got}): it is {_where(stacks[r].where())}"
                     if r in stacks else f"rank {r} never called it ({got})")
    return [Finding("missing", group, seq, "; ".join(parts))]


def _where(where: str) -> str:
    return where if where.startswith(("in ", "idle", "dead")) else f"at {where}"


def _death_findings(dead: Iterable[RankTail]) -> list[Finding]:
    """A rank that died inside a collective (its persisted records): the
    others wait in it for a rank that will not come."""
    out = []
    for t in sorted(dead, key=lambda t: (t.rank, t.dead or 0)):
        died = [rec for rec in t.ops if rec.state == DIED]
        if died:
            rec = died[-1]
            on = "" if rec.group == DEFAULT_GROUP else f" on {group_label(rec.group)}"
            out.append(Finding("died", rec.group, rec.seq,
                               f"rank {t.rank} died in #{rec.seq} {rec.describe()}{on} from "
                               f"{rec.where()} (incarnation {t.dead}; its persisted records)"))
    return out


def _earlier_findings(report: CollectiveReport, tails: Mapping[int, RankTail],
                      dead: list[RankTail], members: Mapping[str, tuple[int, ...]],
                      stacks: Mapping[int, RankStacks]) -> None:
    """Dead incarnations of an earlier generation, lined up with the other
    ranks' records of that generation (the survivors' rings still hold
    them): the collective the rank died in, both sides."""
    for gen in sorted({t.generation for t in dead}):
        gone = {t.rank: t for t in dead if t.generation == gen}  # the newest death of each rank
        view = {r: RankTail(r, t.collectives(gen), generation=gen)
                for r, t in tails.items() if r not in gone}
        view.update({r: RankTail(r, t.collectives(gen), generation=gen, dead=t.dead)
                     for r, t in gone.items()})
        view = {r: t for r, t in view.items() if t.ops}
        when = f"before {label(sorted(gone))} died"
        # the survivors are the same processes: where they are now is where
        # they are; the dead are dead
        where = {**stacks, **{r: RankStacks(r, status=f"dead (incarnation {t.dead})")
                              for r, t in gone.items()}}
        for group in sorted({rec.group for t in view.values() for rec in t.ops},
                            key=lambda g: (len(g), g)):
            used = [r for r, t in view.items() if any(rec.group == group for rec in t.ops)]
            ranks = tuple(sorted(set(used) | (set(members.get(group, ())) & set(view))))
            per_rank = {r: {rec.seq: rec for rec in view[r].ops if rec.group == group}
                        for r in ranks}
            last = {r: (recs[max(recs)] if recs else None) for r, recs in per_rank.items()}
            if not any(r in gone for r in ranks):
                continue  # the dead did not take part: the current view tells it
            report.groups.append(GroupProgress(group, ranks, last, when))
            for f in _group_findings(group, ranks, per_rank, last, where, view):
                if f.kind != "waiting":
                    report.findings.append(Finding(f.kind, f.group, f.seq, f"{when}: {f.text}"))


def _p2p_findings(tails: Mapping[int, RankTail]) -> list[Finding]:
    out = []
    for r, t in sorted(tails.items()):
        for rec in t.ops:
            if rec.p2p and rec.state == IN_FLIGHT and rec.generation == t.generation:
                out.append(Finding("p2p", rec.group, rec.seq,
                                   f"rank {r} waits in {rec.describe()} ({rec.where()})"))
    return out


# -- stragglers ------------------------------------------------------------------------

STRAGGLER_FACTOR = 1.5
WINDOW_STEPS = 20
# torch's records are taken over the wrappers' when their window ends this
# much later (the same collective is in both, torch's a few µs later)
NEWER_S = 1.0


@dataclass(frozen=True)
class RankPace:
    """One rank's figures over the window (seconds)."""

    rank: int
    collectives: int  # collectives in the window
    compute_s: float  # between its collectives
    wait_s: float  # inside them
    ratio: float  # compute / the median rank's compute
    steps_per_s: float | None = None  # from mnb.log, where it logs
    slow: bool = False

    @property
    def wait_share(self) -> float:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else 0.0


@dataclass(repr=False)
class StragglerReport(_Printed):
    """``mesh.stragglers()``: per-rank pace; ``slow`` lists the flagged ranks."""

    ranks: dict[int, RankPace] = field(default_factory=dict)
    window: str = ""
    factor: float = STRAGGLER_FACTOR

    @property
    def slow(self) -> list[int]:
        return sorted(r for r, p in self.ranks.items() if p.slow)

    def render(self) -> str:
        if not self.ranks:
            return "stragglers: no collectives recorded yet"
        head = (f"stragglers: {label(self.slow)} consistently slower "
                f"(>= {self.factor:g}x the median compute time)" if self.slow
                else f"stragglers: none (no rank >= {self.factor:g}x the median compute time)")
        lines = [head, f"  over {self.window}",
                 f"  {'rank':>4} {'compute s':>10} {'wait s':>8} {'wait %':>7} {'x median':>9} "
                 f"{'steps/s':>8}"]
        for r, p in sorted(self.ranks.items()):
            sps = "-" if p.steps_per_s is None else f"{p.steps_per_s:.2f}"
            flag = "  <- slow" if p.slow else ""
            lines.append(f"  {r:>4} {p.compute_s:>10.3f} {p.wait_s:>8.3f} "
                         f"{100 * p.wait_share:>6.0f}% {p.ratio:>8.2f}x {sps:>8}{flag}")
        return "\n".join(lines)


def stragglers(tails: Mapping[int, RankTail], steps_per_s: Mapping[int, float | None] | None = None,
               window_steps: int = WINDOW_STEPS, factor: float = STRAGGLER_FACTOR,
               group: str | None = None) -> StragglerReport:
    """Who is slow, from the recorders. The window is the last
    ``window_steps`` steps where the ranks log them with ``mnb.log`` (their
    steps per second say how long that is), else the last ``window_steps``
    collectives of the group most used. A collective that is still in
    flight is left out (its wait has not ended)."""
    ours, ours_end = _stragglers(tails, steps_per_s or {}, window_steps, factor, group)
    # torch's own records hold DDP's and FSDP's collectives too (and the
    # wrapped ones): used when they are the more recent, i.e. the ranks
    # have been training through DDP since their last wrapped collective
    torch_tails = {r: t.torch_view() for r, t in tails.items()}
    theirs, theirs_end = _stragglers(torch_tails, steps_per_s or {}, window_steps, factor,
                                     group, by_arrival=True)
    if theirs.ranks and (not ours.ranks or theirs_end > ours_end + NEWER_S):
        return theirs
    return ours


def _stragglers(tails: Mapping[int, RankTail], steps_per_s: Mapping[int, float | None],
                window_steps: int, factor: float, group: str | None,
                by_arrival: bool = False) -> tuple[StragglerReport, float]:
    """``by_arrival``: the records' end times are unknown (torch's own
    recorder does not time a gloo op's end), so a collective is taken to
    end when its last member arrives: a member waits from its own arrival
    to the last one's, and computes from there to its next arrival. The
    slow rank is the one the others wait for, as with measured ends.
    Returns the report and the time its window ends (0 when empty)."""
    generation = max((t.generation for t in tails.values()), default=0)
    series = {r: [rec for rec in t.collectives(generation) if rec.t1 is not None]
              for r, t in tails.items() if t.generation == generation}
    if group is None:
        counts: dict[str, int] = {}
        for recs in series.values():
            for rec in recs:
                counts[rec.group] = counts.get(rec.group, 0) + 1
        group = max(counts, key=lambda g: counts[g]) if counts else None
    if group is None:
        return StragglerReport(factor=factor), 0.0
    series = {r: [rec for rec in recs if rec.group == group] for r, recs in series.items()}
    series = {r: recs for r, recs in series.items() if len(recs) >= 2}
    if not series:
        return StragglerReport(factor=factor), 0.0
    # the same collectives on every rank: the newest numbers all have
    common = set.intersection(*({rec.seq for rec in recs} for recs in series.values()))
    if len(common) < 2:
        return StragglerReport(factor=factor), 0.0
    rates = [v for v in steps_per_s.values() if v]
    span_s = window_steps / statistics.median(rates) if rates else None
    newest = max(common)
    n_window = window_steps
    window = f"the last {window_steps} collectives of {group_label(group)}"
    if span_s is not None:  # as many collectives as the last window_steps steps took
        ref = next(iter(series.values()))
        end = next(rec.t1 for rec in ref if rec.seq == newest)
        assert end is not None
        n_window = sum(1 for rec in ref if rec.seq in common and rec.t0 >= end - span_s)
        window = f"the last {window_steps} steps ({n_window} collectives of {group_label(group)})"
    seqs = sorted(common)[-max(2, n_window + 1):]
    compute: dict[int, float] = {}
    wait: dict[int, float] = {}
    by_seq = {r: {rec.seq: rec for rec in recs} for r, recs in series.items()}
    # by arrival: each collective ends when its last member arrives
    last_in = {seq: max(by_seq[r][seq].t0 for r in series) for seq in seqs}
    for r in series:
        mine = by_seq[r]
        c = w = 0.0
        for prev, seq in itertools.pairwise(seqs):
            a, b = mine[prev], mine[seq]
            if by_arrival:
                c += max(0.0, b.t0 - last_in[prev])
                w += last_in[seq] - b.t0
            else:
                assert a.t1 is not None and b.t1 is not None
                c += max(0.0, b.t0 - a.t1)
                w += b.t1 - b.t0
        compute[r], wait[r] = c, w
    if by_arrival:
        window += f", in {TORCH_VIEW}"
    report = StragglerReport(window=window, factor=factor)
    for r in sorted(series):
        # against the others' median: with few ranks the slow one would
        # otherwise pull the median towards itself
        others = [v for q, v in compute.items() if q != r] or [compute[r]]
        median = statistics.median(others)
        ratio = compute[r] / median if median > 0 else 1.0
        report.ranks[r] = RankPace(r, len(seqs) - 1, compute[r], wait[r], ratio,
                                   steps_per_s.get(r), slow=len(series) > 1 and ratio >= factor)
    return report, max(last_in.values())


__all__ = ["RankTail", "Finding", "GroupProgress", "CollectiveReport", "analyze",
           "RankPace", "StragglerReport", "stragglers"]
