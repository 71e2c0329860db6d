"""GPU checks (``make gpu-check``): what only a CUDA or ROCm machine can show.

One rank per visible GPU (at most 8), then, each within the 8-minute budget:

* pinning: every rank sees exactly one device, and no two ranks the same one;
* NCCL (RCCL on ROCm): an all_reduce and a broadcast of GPU tensors;
* health: the dashboard's GPU figures (memory, utilisation, temperature,
  power) come from nvidia-ml-py / amdsmi, not n/a;
* a GPU rank killed (SIGKILL) comes back on its device and the group works;
* a DDP step: gradients averaged, the replicas stay equal.

Prints a table ``check | result | figure`` and exits 0 when every check
passed, 1 otherwise. Without a GPU it prints ``skipped: no GPU`` and exits 0.

Non-goals: performance figures (benchmarks/), CPU meshes (the test suite).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

BUDGET_S = 8 * 60
MAX_RANKS = 8
CALL_TIMEOUT_S = 120.0


def _visible() -> Any:
    from monarch_nb import backends

    try:
        return backends.resolve("auto")
    except Exception as exc:  # no torch, a broken driver
        print(f"skipped: no GPU ({exc})")
        return None


# -- what the ranks run (shipped by value) ----------------------------------------------------
def _pinning() -> tuple[int, str, str]:
    import os

    import torch

    var = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    props = torch.cuda.get_device_properties(0)
    uuid = str(getattr(props, "uuid", "")) or os.environ.get(var, "")
    return torch.cuda.device_count(), os.environ.get(var, ""), uuid


def _collectives() -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    t = torch.full((1024,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    b = torch.full((4,), float(dist.get_rank() + 7), device="cuda")
    dist.broadcast(b, src=0)
    torch.cuda.synchronize()
    return float(t[0].item()), float(b[0].item())


def _load() -> float:
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = (x @ x).tanh()
    torch.cuda.synchronize()
    return float(x.abs().mean().item())


def _ddp_step() -> tuple[float, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).cuda()
    ddp = DDP(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(32, 64, device="cuda") * (dist.get_rank() + 1)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return float(loss.item()), float(model.weight.detach().sum().item())


# -- the checks -------------------------------------------------------------------------------
class Checks:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.deadline = time.monotonic() + BUDGET_S

    def check(self, name: str, fn: Callable[[], str]) -> None:
        if time.monotonic() > self.deadline:
            self.rows.append((name, "SKIP", "out of time"))
            return
        t0 = time.monotonic()
        try:
            figure = fn()
            self.rows.append((name, "ok", f"{figure} ({time.monotonic() - t0:.1f} s)"))
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.rows.append((name, "FAIL", text[:120]))

    def table(self) -> str:
        w0 = max(len("check"), *(len(r[0]) for r in self.rows))
        w1 = max(len("result"), *(len(r[1]) for r in self.rows))
        lines = [f"{'check':<{w0}} | {'result':<{w1}} | figure",
                 f"{'-' * w0}-+-{'-' * w1}-+-------"]
        lines += [f"{a:<{w0}} | {b:<{w1}} | {c}" for a, b, c in self.rows]
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        return all(r[1] == "ok" for r in self.rows)


def _expect(cond: bool, text: str) -> None:
    if not cond:
        raise AssertionError(text)


def main() -> int:
    info = _visible()
    if info is None:
        return 0
    if info.name == "cpu" or not info.devices:
        print("skipped: no GPU (torch sees no CUDA or ROCm device here)")
        return 0
    from monarch_nb import Mesh

    n = min(len(info.devices), MAX_RANKS)
    checks = Checks()
    box: dict[str, Any] = {}

    def start() -> str:
        t0 = time.monotonic()
        box["mesh"] = Mesh.start(n=n, backend="auto", hang_timeout=None)
        return f"{n} rank(s) on {info.name} in {time.monotonic() - t0:.1f} s"

    checks.check("start", start)
    mesh = box.get("mesh")
    if mesh is None:
        print(checks.table())
        return 1
    try:
        def pinning() -> str:
            res = mesh.run(_pinning, timeout=CALL_TIMEOUT_S)
            counts = {r: v[0] for r, v in res.items()}
            _expect(all(c == 1 for c in counts.values()), f"devices seen per rank: {counts}")
            ids = [v[2] for v in res.values()]
            _expect(len(set(ids)) == n, f"ranks share a device: {ids}")
            return ", ".join(f"{r}->{v[1]}" for r, v in sorted(res.items()))

        def collectives() -> str:
            res = mesh.run(_collectives, timeout=CALL_TIMEOUT_S)
            want = n * (n + 1) / 2
            _expect(all(v == (want, 7.0) for v in res.values()), f"got {dict(res)}")
            return f"all_reduce {want:g}, broadcast 7 on {mesh.backend}"

        def health() -> str:
            mesh.run(_load, timeout=CALL_TIMEOUT_S)
            fields = ("gpu_mem", "gpu_mem_total", "gpu_util", "gpu_temp", "gpu_power")
            missing: list[str] = []
            until = time.monotonic() + 15
            while time.monotonic() < until:
                rows = mesh.status()
                missing = [f"{r['rank']}:{f}" for r in rows for f in fields if r.get(f) is None]
                if not missing:
                    r0 = rows[0]
                    return (f"rank 0: {r0['gpu_mem'] / 1e9:.1f}/{r0['gpu_mem_total'] / 1e9:.0f} GB, "
                            f"{r0['gpu_util']:.0f}%, {r0['gpu_temp']:.0f} C, {r0['gpu_power']:.0f} W")
                mesh.wait_any([], 0.5)
            raise AssertionError(f"n/a: {', '.join(missing[:6])}")

        def kill_and_back() -> str:
            victim = n - 1
            before = mesh.run(_pinning, timeout=CALL_TIMEOUT_S)[victim][2]
            t0 = time.monotonic()
            mesh.kill(victim)
            res = mesh.run(_collectives, timeout=CALL_TIMEOUT_S)  # waits for the respawn
            back = time.monotonic() - t0
            want = n * (n + 1) / 2
            _expect(all(v == (want, 7.0) for v in res.values()), f"group after respawn: {dict(res)}")
            after = mesh.run(_pinning, timeout=CALL_TIMEOUT_S)[victim][2]
            _expect(after == before, f"rank {victim} came back on another device ({after})")
            inc = mesh.status()[victim]["incarnation"]
            _expect(inc >= 1, "the rank was not respawned")
            return f"rank {victim} back in {back:.1f} s, same device, incarnation {inc}"

        def ddp() -> str:
            res = mesh.run(_ddp_step, timeout=CALL_TIMEOUT_S)
            weights = {round(v[1], 5) for v in res.values()}
            _expect(len(weights) == 1, f"replicas differ after the step: {weights}")
            return f"loss {res[0][0]:.4g}, replicas equal"

        checks.check("pinning", pinning)
        checks.check("nccl all_reduce+broadcast", collectives)
        checks.check("health figures", health)
        checks.check("kill a GPU rank, back", kill_and_back)
        checks.check("DDP step", ddp)
    finally:
        mesh.stop()
    print(checks.table())
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
