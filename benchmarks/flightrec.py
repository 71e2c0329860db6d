#!/usr/bin/env python3
"""What the collective flight recorder costs: one command, one table.

    .venv/bin/python benchmarks/flightrec.py [--quick] [--json out.json]

In this process, in a 1-rank gloo group (the recorder's cost does not
depend on the number of ranks: it is Python work on the calling rank):

1. ``dist.all_reduce`` of a float32[8] tensor, with and without the
   recorder's wrapper (engine/flightrec.py), in alternating rounds;
2. the wrapper alone, around a no-op stand-in with all_reduce's signature
   (the recorder's own time, without gloo's noise);
3. a small training step (a 3-layer MLP, forward, backward, one all_reduce
   per parameter for the gradients, SGD), with and without;
4. strict mode (``check_collectives=True``) on that all_reduce: the store
   round trip each collective adds (with one rank the exchange is with
   itself, through the TCP store: the floor of what it costs);
5. the ring kept in a memory-mapped file too (what survives a rank's death,
   on by default on ranks): the wrapper around the no-op, without and with
   that file, and the all_reduce and training step above run with it;
6. torch's own flight recorder (``TORCH_FR_BUFFER_SIZE``, which ranks turn
   on to see DDP's and FSDP's collectives) on that all_reduce: torch reads
   the size once per process, so each side runs in child processes,
   alternating, the best kept.

Each figure is the best round's mean time per call; "added" is with minus
without. On a loaded 2-core VM gloo's own time moves by tens of µs from
round to round: the no-op line is the one to read for the recorder's cost.
No assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from monarch_nb.engine import context, flightrec  # noqa: E402


def per_call(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def compare(plain: Callable[[], None], recorded: Callable[[], None], n: int,
            rounds: int) -> tuple[float, float]:
    """Per-call µs without and with the recorder: the best of alternating
    rounds (the least disturbed by other work on the machine)."""
    a, b = [], []
    per_call(plain, n // 4)
    per_call(recorded, n // 4)
    for _ in range(rounds):
        a.append(per_call(plain, n))
        b.append(per_call(recorded, n))
    return min(a), min(b)


def torch_recorder_child(n: int, rounds: int, port: int) -> None:
    """Print the best round's µs per all_reduce in this process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.ones(8)
    per_call(lambda: dist.all_reduce(x), n)
    print(min(per_call(lambda: dist.all_reduce(x), n) for _ in range(rounds)))
    dist.destroy_process_group()


def torch_recorder_row(n: int, rounds: int) -> tuple[float, float]:
    import subprocess

    best = {"off": float("inf"), "on": float("inf")}
    for i in range(3):
        for side in ("off", "on"):
            env = {k: v for k, v in os.environ.items() if k != flightrec.TORCH_FR_ENV}
            if side == "on":
                env[flightrec.TORCH_FR_ENV] = str(flightrec.TORCH_RING_SIZE)
            out = subprocess.run([sys.executable, __file__, "--torch-fr-child", str(n),
                                  str(rounds), str(29600 + 2 * i + (side == "on"))],
                                 env=env, capture_output=True, text=True, check=True)
            best[side] = min(best[side], float(out.stdout.strip().splitlines()[-1]))
    return best["off"], best["on"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--torch-fr-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_fr_child:
        torch_recorder_child(*args.torch_fr_child)
        return
    # many short rounds: gloo's own time drifts within a long one
    n, rounds = (300, 10) if args.quick else (500, 40)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    context._set(rank=0, world_size=1, generation=0)
    raw = dist.all_reduce
    import tempfile

    kept = tempfile.mkdtemp(prefix="mnb-flightrec-bench-")
    persisting = hasattr(flightrec, "persist")  # main's code before issue 29 has none
    if persisting:
        flightrec.persist(os.path.join(kept, "rank0.flight"))
    flightrec.install()
    wrapped = dist.all_reduce
    flightrec.uninstall()
    rows: list[tuple[str, float, float]] = []

    x = torch.ones(8)
    rows.append(("all_reduce float32[8], 1-rank gloo (µs/call)",
                 *compare(lambda: raw(x), lambda: wrapped(x), n, rounds)))

    def noop(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    rec = flightrec.Recorder()
    noop_wrapped = flightrec._wrap("all_reduce", noop, rec)
    rows.append(("wrapper around a no-op (µs/call)",
                 *compare(lambda: noop(x), lambda: noop_wrapped(x), n * 10, rounds)))

    if persisting:
        kept_rec = flightrec.Recorder()
        flightrec.persist(os.path.join(kept, "noop.flight"), kept_rec)
        noop_kept = flightrec._wrap("all_reduce", noop, kept_rec)
        rows.append(("wrapper around a no-op, ring in a file (µs/call)",
                     *compare(lambda: noop_wrapped(x), lambda: noop_kept(x), n * 10, rounds)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    params = list(model.parameters())

    def step(all_reduce: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(model(data), target)
            loss.backward()
            for p in params:
                all_reduce(p.grad)
            opt.step()
        return run

    rows.append((f"training step: MLP, {len(params)} all_reduces (µs/step)",
                 *compare(step(raw), step(wrapped), max(50, n // 5), rounds)))

    strict = flightrec.Recorder()
    strict_wrapped = flightrec._wrap("all_reduce", raw, strict)
    flightrec.begin_check(1, strict)
    rows.append(("all_reduce float32[8], strict mode (µs/call)",
                 *compare(lambda: wrapped(x), lambda: strict_wrapped(x), max(50, n // 5),
                          max(3, rounds // 4))))
    flightrec.end_check(True, strict)
    dist.destroy_process_group()
    import shutil

    shutil.rmtree(kept, ignore_errors=True)
    rows.append(("all_reduce float32[8], torch's own recorder (µs/call)",
                 *torch_recorder_row(n * 2, rounds)))

    print(f"collective flight recorder cost ({'quick' if args.quick else 'full'} run, "
          f"{rounds} rounds, torch {torch.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'measure':<54} {'without':>10} {'with':>10} {'added':>9}")
    for name, without, with_ in rows:
        print(f"{name:<54} {without:>10.2f} {with_:>10.2f} {with_ - without:>+9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"measure": m, "without_us": a, "with_us": b} for m, a, b in rows], indent=1))


if __name__ == "__main__":
    main()
