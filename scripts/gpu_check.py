"""GPU checks (``make gpu-check``): what only a CUDA or ROCm machine can show.

One rank per visible GPU (at most 8), then, each within the 8-minute budget:

* pinning: every rank sees exactly one device, and no two ranks the same one;
* NCCL (RCCL on ROCm): an all_reduce and a broadcast of GPU tensors;
* health: the dashboard's GPU figures (memory, utilisation, temperature,
  power) come from nvidia-ml-py / amdsmi, not n/a;
* a GPU rank killed (SIGKILL) comes back on its device and the group works;
* the ranks, the respawned one too, were forked from the warm process
  (docs/warm-process.md), which still runs one thread (it never initialised
  the device: the checks above ran on forked ranks);
* a DDP step: gradients averaged, the replicas stay equal;
* the flight recorder on NCCL/RCCL: the wrappers' records of the
  all_reduce and broadcast above, and torch's own recorder's records of
  DDP's collectives, read back through ``mesh.collectives()``;
* moving a 256 MiB CUDA tensor controller -> ranks (push) and back (pull),
  first by the host (the default: copied to the host, arriving on the CPU),
  then on a second mesh with ``gpu_ipc=True`` (by CUDA IPC handle, arriving
  on the GPU): each rank's tensor equals the source and is its own
  (writes on either side are not seen by the other), the IPC mesh used no
  shared-memory segment for it, GB/s of both paths side by side, and
  nothing leaked (no share left, GPU memory back to where it was after
  ``del`` and ``empty_cache``). docs/gpu-dataplane.md says what to expect.

Prints a table ``check | result | figure`` and exits 0 when every check
passed, 1 otherwise. Without a GPU it prints ``skipped: no GPU`` and exits 0.

Non-goals: performance figures beyond the two transfer paths (benchmarks/),
CPU meshes (the test suite).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

BUDGET_S = 8 * 60
MAX_RANKS = 8
CALL_TIMEOUT_S = 120.0
TRANSFER_BYTES = 256 << 20
LEAK_WAIT_S = 10.0  # a rank releases a pulled tensor's share when the controller's RELEASE comes


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


def _digest(t: Any) -> tuple[int, int]:
    """An exact fingerprint of a float32 tensor's bits, computed where it is
    (both sums fit in int64: no overflow, no rounding)."""
    import torch

    v = t.detach().reshape(-1).view(torch.int32).to(torch.int64)
    w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 65521 + 1
    return int(v.sum().item()), int(((v % 65521) * w).sum().item())


def _place(name: str) -> str:
    """The pushed tensor on this rank's GPU (the host path's last step:
    it arrived on the CPU); the device it is on."""
    import torch

    import __main__

    ns = vars(__main__)
    if not ns[name].is_cuda:
        ns[name] = ns[name].to("cuda")
    torch.cuda.synchronize()
    return str(ns[name].device)


def _rank_digest(name: str) -> tuple[str, tuple[int, int]]:
    import __main__

    t = vars(__main__)[name]
    return str(t.device), _digest(t)


def _bump(name: str) -> None:
    import torch

    import __main__

    vars(__main__)[name].add_(1)
    torch.cuda.synchronize()


def _gpu_memory() -> tuple[int, int]:
    """This rank's allocated GPU bytes and its GPU IPC shares not released."""
    import gc

    import torch

    from monarch_nb.wire import gpuipc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated()), gpuipc.outstanding()


def _forget(name: str) -> None:
    import __main__

    vars(__main__).pop(name, None)


class Transfer:
    """Push then pull a TRANSFER_BYTES CUDA tensor on one mesh, checking
    values, independence and (flag on) the route; figures in GB/s."""

    def __init__(self, mesh: Any, n: int, ipc: bool) -> None:
        import torch

        self.mesh, self.n, self.ipc = mesh, n, ipc
        g = torch.Generator(device="cuda:0").manual_seed(7)
        # whole numbers: +1 and -1 are exact, so a write and its undo restore the bits
        base = torch.randint(-1000, 1000, (TRANSFER_BYTES // 4,), device="cuda:0",
                             generator=g).to(torch.float32)
        # rank r's GPU is this process's cuda:r (backends.pin_env); pushing to
        # each rank from its own GPU is what lets IPC serve every rank
        self.srcs = [base if r == 0 else base.to(f"cuda:{r}") for r in range(n)]
        self.want = _digest(base)
        torch.cuda.synchronize()
        self.rank_base: dict[int, tuple[int, int]] = {}
        self.local_base = 0

    def push(self) -> str:
        import torch

        mesh, n = self.mesh, self.n
        self.rank_base = dict(mesh.run(_gpu_memory, timeout=CALL_TIMEOUT_S))
        torch.cuda.synchronize()
        self.local_base = torch.cuda.memory_allocated()
        before = dict(mesh.dataplane)
        t0 = time.perf_counter()
        for r in range(n):
            mesh[r].push(gx=self.srcs[r])
        placed = mesh.run(_place, "gx", timeout=CALL_TIMEOUT_S)
        took = time.perf_counter() - t0
        segments = mesh.dataplane["segments"] - before["segments"]
        got = mesh.run(_rank_digest, "gx", timeout=CALL_TIMEOUT_S)
        _expect(all(v == ("cuda:0", self.want) for v in got.values()),
                f"ranks' tensors differ from the source: {dict(got)} (want {self.want})")
        if self.ipc:
            _expect(segments == 0, f"{segments} shared-memory segment(s): the push went by the host")
        else:
            _expect(segments == n, f"{segments} shared-memory segment(s) for {n} push(es)")
        # independence: a write on a rank is not seen by the source or by the
        # other ranks; a write to the source is not seen by the ranks
        mesh[0].run(_bump, "gx", timeout=CALL_TIMEOUT_S)
        _expect(_digest(self.srcs[0]) == self.want, "a rank's write changed the controller's source")
        self.srcs[0].add_(1)
        got = mesh.run(_rank_digest, "gx", timeout=CALL_TIMEOUT_S)
        self.srcs[0].sub_(1)
        bumped = _digest(self.srcs[0] + 1)
        _expect(got[0][1] == bumped, "rank 0's write was lost")
        _expect(all(got[r][1] == self.want for r in range(1, n)),
                "rank 0's write (or the source's) is seen by another rank")
        return (f"{_gbs(n * TRANSFER_BYTES, took)} GB/s ({n} x 256 MiB in {took * 1e3:.0f} ms, "
                f"on {placed[0]}), each rank's own copy")

    def pull(self) -> str:
        import torch

        mesh, n = self.mesh, self.n
        before = dict(mesh.dataplane)
        t0 = time.perf_counter()
        res = mesh.pull("gx")
        back = {r: v if v.is_cuda else v.to(f"cuda:{r}") for r, v in res.items()}
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        mapped = mesh.dataplane["mapped"] - before["mapped"]
        del res
        bumped = _digest(self.srcs[0] + 1)
        _expect(_digest(back[0]) == bumped, "rank 0's tensor came back different")
        _expect(all(_digest(back[r]) == self.want for r in range(1, n)),
                "a rank's tensor came back different")
        if self.ipc:
            _expect(all(back[r].device == torch.device(f"cuda:{r}") for r in range(n)),
                    f"pulled tensors are not on the ranks' GPUs: {[str(v.device) for v in back.values()]}")
            _expect(mapped == 0, f"{mapped} result(s) came by shared memory, not by handle")
        back[0].zero_()  # the controller's copy is its own too
        got = mesh.run(_rank_digest, "gx", timeout=CALL_TIMEOUT_S)
        _expect(got[0][1] == bumped, "the controller's write reached rank 0")
        del back
        return f"{_gbs(n * TRANSFER_BYTES, took)} GB/s ({n} x 256 MiB in {took * 1e3:.0f} ms)"

    def no_leak(self) -> str:
        import gc

        import torch

        from monarch_nb.wire import gpuipc

        mesh = self.mesh
        mesh.run(_forget, "gx", timeout=CALL_TIMEOUT_S)
        until = time.monotonic() + LEAK_WAIT_S
        while True:
            now = dict(mesh.run(_gpu_memory, timeout=CALL_TIMEOUT_S))
            grown = {r: (now[r][0] - self.rank_base[r][0], now[r][1]) for r in now
                     if now[r][0] > self.rank_base[r][0] or now[r][1]}
            if not grown or time.monotonic() > until:
                break
            time.sleep(0.2)
        _expect(not grown, f"ranks kept (bytes, shares): {grown}")
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        local = torch.cuda.memory_allocated() - self.local_base
        _expect(local <= 0, f"the controller kept {local} bytes of GPU memory")
        _expect(gpuipc.outstanding() == 0, f"the controller holds {gpuipc.outstanding()} share(s)")
        return "ranks and controller back to their baselines, no share left"


def _gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.1f}"


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

        def forked() -> str:
            # the ranks (the respawned one too) were forked from the warm
            # process, which never initialised a device (engine/warm.py)
            import psutil

            sup = mesh._ctl.supervisor
            _expect(not sup.fork_off, f"forking was turned off: {sup.fork_off}")
            _expect(sup.warm is not None, "no warm process")
            not_forked = [r for r, p in sup.procs.items() if not p.forked]
            _expect(not not_forked, f"ranks not forked: {not_forked}")
            warm = psutil.Process(sup.warm.pid)
            _expect(warm.num_threads() == 1, f"the warm process runs {warm.num_threads()} threads")
            driver = sorted({m.path.rsplit("/", 1)[-1] for m in warm.memory_maps()
                             if "libcuda.so" in m.path or "libamdhip" in m.path})
            return (f"{len(sup.procs)} forked rank(s) on their GPUs, the respawn too; warm process: "
                    f"1 thread, driver libraries mapped: {', '.join(driver) or 'none'}")

        def ddp() -> str:
            res = mesh.run(_ddp_step, timeout=CALL_TIMEOUT_S)
            weights = {round(v[1], 5) for v in res.values()}
            _expect(len(weights) == 1, f"replicas differ after the step: {weights}")
            return f"loss {res[0][0]:.4g}, replicas equal"

        checks.check("pinning", pinning)
        checks.check("nccl all_reduce+broadcast", collectives)
        checks.check("health figures", health)
        checks.check("kill a GPU rank, back", kill_and_back)
        checks.check("ranks forked from the warm process", forked)
        def recorder() -> str:
            report = mesh.collectives()
            _expect(report.ok, f"findings on a healthy mesh: {report.summary()}")
            ops = {rec.op for t in report.tails.values() for rec in t.ops}
            _expect({"all_reduce", "broadcast"} <= ops, f"wrapped ops recorded: {sorted(ops)}")
            torch_ops = [rec for t in report.tails.values() for rec in t.torch_ops]
            _expect(bool(torch_ops), "torch's own recorder gave no record (DDP's collectives)")
            devices = {rec.device for t in report.tails.values() for rec in t.ops if rec.device}
            return (f"{sum(len(t.ops) for t in report.tails.values())} wrapped on {sorted(devices)}, "
                    f"{len(torch_ops)} from torch's recorder, e.g. {torch_ops[-1].describe()}")

        checks.check("DDP step", ddp)
        checks.check("flight recorder (nccl)", recorder)
        transfer(checks, mesh, n, ipc=False)
    finally:
        mesh.stop()
    box.pop("mesh")

    def start_ipc() -> str:
        t0 = time.monotonic()
        box["mesh"] = Mesh.start(n=n, backend="auto", hang_timeout=None, gpu_ipc=True)
        return f"{n} rank(s) with gpu_ipc in {time.monotonic() - t0:.1f} s"

    checks.check("start (gpu_ipc)", start_ipc)
    ipc_mesh = box.get("mesh")
    if ipc_mesh is not None:
        try:
            transfer(checks, ipc_mesh, n, ipc=True)
        finally:
            ipc_mesh.stop()
    print(checks.table())
    return 0 if checks.passed else 1


def transfer(checks: Checks, mesh: Any, n: int, ipc: bool) -> None:
    """The push, pull and leak checks of one path (one mesh)."""
    path = "gpu_ipc" if ipc else "host"
    box: dict[str, Transfer] = {}

    def setup() -> str:
        box["t"] = Transfer(mesh, n, ipc)
        return f"{TRANSFER_BYTES >> 20} MiB float32 on cuda:0..{n - 1}"

    checks.check(f"transfer setup ({path})", setup)
    if "t" not in box:
        return
    t = box["t"]
    checks.check(f"push 256 MiB ({path})", t.push)
    checks.check(f"pull 256 MiB ({path})", t.pull)
    checks.check(f"no leak ({path})", t.no_leak)


if __name__ == "__main__":
    sys.exit(main())
