"""The mesh status table: ``%monarch status`` and the dashboard's text
fallback print the same one. Below both front ends and below the facade: it
reads a mesh's public API (``status()``, ``world_size``, ``backend``,
``running``, ``dropped``) and imports no front end and not mesh itself, so
``Mesh.dashboard()`` can reach the widget without an import cycle.
"""

from __future__ import annotations

from typing import Any

from ..errors import lost_host_hint
from ..selection import format_ranks


def _bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    return f"{b / 1e9:.1f}G" if b >= 1e9 else f"{b / 1e6:.0f}M"


def _gpu(r: dict[str, Any]) -> str:
    if r.get("gpu_mem_total") is None:
        return "n/a"
    extra = [f"{v:.0f}{unit}" if v is not None else "n/a" for v, unit in
             ((r.get("gpu_util"), "%"), (r.get("gpu_temp"), "C"), (r.get("gpu_power"), "W"))]
    return (f"{_bytes(r['gpu_mem'])}/{_bytes(r['gpu_mem_total'])} peak {_bytes(r['gpu_mem_peak'])} "
            + " ".join(extra))


def format_status(mesh: Any) -> str:
    """The status table of ``%monarch status`` and of the dashboard's text
    fallback (n/a: not measured here, e.g. no GPU or no NVML)."""
    rows = mesh.status()
    head = f"mesh: {mesh.world_size} ranks · {mesh.backend} · " + (
        "running" if mesh.running else "stopped")
    lines = [head, f"{'rank':>4}  {'state':<10} {'pid':>7}  {'inc':>3}  {'device':<7} "
                   f"{'heartbeat':>9} {'cpu%':>6} {'rss':>6}  {'gpu mem/total peak util temp power':<22} "
                   f"{'steps/s':>8}  last / exit"]
    for r in rows:
        hb = "-" if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.1f}s ago"
        cpu = "n/a" if r.get("cpu") is None else f"{r['cpu']:.0f}"
        sps = "-" if r.get("steps_per_s") is None else f"{r['steps_per_s']:.1f}"
        last = " ".join(f"{k}={v:.4g}" for k, v in (r.get("last") or {}).items())
        tail = "  ".join(x for x in (last, r["exit"]) if x)
        lines.append(f"{r['rank']:>4}  {r['state']:<10} {r['pid'] or '-':>7}  {r['incarnation']:>3}  "
                     f"{r['device'] or '-':<7} {hb:>9} {cpu:>6} {_bytes(r.get('rss')):>6}  "
                     f"{_gpu(r):<22} {sps:>8}  {tail}".rstrip())
    shrunk = group_line(rows)
    if shrunk:
        lines.append(shrunk)
    dead = [r["rank"] for r in rows if r["state"] in ("dead", "waiting")]
    if dead:
        lines.append(f"dead: rank {format_ranks(dead)}")
    for lost in lost_hosts(rows):
        lines.append(f"lost: host {lost['host']} (rank {lost['ranks']}): {lost['hint']}")
    dropped = mesh.dropped
    if dropped:
        lines.append("dropped messages: " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))
    return "\n".join(lines)


def group_line(rows: list[dict[str, Any]]) -> str:
    """The torch group's size now when it went on without some ranks
    (``min_ranks``), else "": for ``%monarch status`` and the dashboard."""
    out = [r["rank"] for r in rows if "torch_rank" in r and r["torch_rank"] is None]
    if not out:
        return ""
    members = [r["rank"] for r in rows if r.get("torch_rank") is not None]
    return (f"world size now: {len(members)} of {len(rows)} (rank {format_ranks(members)}; "
            f"the group went on without rank {format_ranks(out)})")


def lost_hosts(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The hosts lost with ranks still on them (``lost`` rows or tiles): per
    host its name, its ranks ("2,3") and what to do, for ``%monarch status``
    and the dashboard alike."""
    ranks: dict[str, list[int]] = {}
    for r in sorted(rows, key=lambda r: int(r["rank"])):
        if r["state"] == "lost":
            ranks.setdefault(r.get("lost_host") or "?", []).append(r["rank"])
    return [{"host": host, "ranks": format_ranks(rs), "hint": lost_host_hint(rs)}
            for host, rs in ranks.items()]


__all__ = ["format_status", "group_line", "lost_hosts"]
