"""The cells of the example notebooks in ``notebooks/`` (scripts/build_notebooks.py
writes and executes them; nbval re-runs them in ``make test``).

Cells whose output carries meaning (rank sums, ``True`` for equality after a
kill) start with ``# NBVAL_CHECK_OUTPUT`` (second line in a ``%%monarch``
cell); nbval compares only those with the stored outputs. Cells meant to fail
are tagged ``raises-exception``. Every notebook starts and stops its own mesh.

Non-goals: executing or checking (build_notebooks.py, nbval).
"""

from __future__ import annotations

Cell = tuple[str, str, list[str]]


def md(text: str) -> Cell:
    return ("md", text.strip("\n"), [])


def code(text: str, *tags: str) -> Cell:
    return ("code", text.strip("\n"), list(tags))


CHECK = "# NBVAL_CHECK_OUTPUT"

QUICKSTART: list[Cell] = [
    md("""
# monarch_nb quickstart

This notebook drives a mesh of four PyTorch rank processes from this kernel. Without GPUs
the ranks are CPU processes joined by gloo, so it runs on any machine; `make demo` runs it
headless. Cells marked `# NBVAL_CHECK_OUTPUT` are the ones whose output `make test`
compares with the output stored here (nbval).
"""),
    md("Load the extension; it adds the `%monarch` line magic and the `%%monarch` cell magic."),
    code("%load_ext monarch_nb"),
    md("""
Start four ranks. Each is a fresh Python process that has joined a `torch.distributed`
group before the first cell runs. The live dashboard appears under the start-up line
(`--no-dashboard` skips it).
"""),
    code("%monarch start -n 4"),
    md("""
A `%%monarch` cell runs on every rank. Here each rank contributes `rank + 1` to an
`all_reduce`, so every rank ends with 1 + 2 + 3 + 4 = 10. Their printed output is gathered
into this cell, each line under its rank.

`mnb.device()` is the rank's device: the CPU here, the rank's own GPU on a GPU machine.
"""),
    code("""
%%monarch
import torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(1, device=mnb.device()) * (mnb.rank() + 1)
dist.all_reduce(x)
print(mnb.rank(), x.item())
"""),
    md("`--ranks` selects a subset of ranks. The value of the cell's last expression comes back per rank."),
    code(f"""
%%monarch --ranks 0,2
{CHECK}
mnb.rank() * 10
"""),
    md("""
`-o NAME` stores the per-rank results in a kernel variable as well. Rank state persists
between cells, so `x` is still there. Ranks that returned equal values are shown once.
"""),
    code(f"""
%%monarch -o sums
{CHECK}
x.item()
"""),
    md("`sums` is an ordinary dict in the notebook kernel (rank -> value)."),
    code(f"""
{CHECK}
sorted(sums.items()), sum(sums.values())
"""),
    md("`%monarch push` copies kernel variables to the ranks ..."),
    code("""
import numpy as np
w = np.arange(6.)
"""),
    code("%monarch push w"),
    code(f"""
%%monarch
{CHECK}
float(w.sum()) + mnb.rank()
"""),
    md("... and `%monarch pull` brings a rank's variable back (`--ranks` again selects)."),
    code(f"""
{CHECK}
%monarch pull w --ranks 1
"""),
    md("""
When ranks fail, their errors are grouped: ranks 1 and 3 raise the same
`ZeroDivisionError`, so one traceback is shown for both. (This cell is tagged
`raises-exception` so that headless runs expect the error.)
"""),
    code("""
%%monarch
if mnb.rank() % 2:
    1/0
""", "raises-exception"),
    md("The mesh stays usable afterwards: every rank answers the next cell."),
    code(f"""
%%monarch
{CHECK}
mnb.rank()
"""),
    md("`%monarch status` shows each rank's state, process, device and health."),
    code("%monarch status"),
    md("Stop the mesh; the rank processes exit."),
    code("%monarch stop"),
]

DDP_TRAINING: list[Cell] = [
    md("""
# Data-parallel training on four ranks

A small regression model trained with `DistributedDataParallel` on four CPU ranks (gloo):
each rank draws its own batches, DDP averages the gradients in `backward()`, so the four
copies of the model stay identical. `mnb.log` feeds the live dashboard's loss curves.
On a GPU machine the same cells run with NCCL, one GPU per rank.
"""),
    code("""
%load_ext monarch_nb
%monarch start -n 4
"""),
    md("""
The model, the optimiser and the data. `torch.manual_seed(0)` gives every rank the same
initial weights (DDP also broadcasts rank 0's when it wraps the model). Each rank's batch
depends on the step and the rank, so the four ranks see different data.
"""),
    code("""
%%monarch
import torch, torch.distributed as dist, monarch_nb as mnb
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
true_w = torch.linspace(-1, 1, 8)[:, None]   # the function to learn: the same everywhere

def batch(step):
    g = torch.Generator().manual_seed(1000 * step + mnb.rank())  # this rank's shard
    x = torch.randn(32, 8, generator=g)
    return x, x @ true_w + 0.3 * torch.tanh(x[:, :1] * x[:, 1:2])

print(f"rank {mnb.rank()} of {dist.get_world_size()}: {sum(p.numel() for p in net.parameters())} parameters")
"""),
    md("""
Train. Every step logs the loss with `mnb.log`; the dashboard above draws one line per rank
while the cell runs (click a rank's tile to highlight its line). Each rank reports its
first and last loss.
"""),
    code("""
%%monarch
losses = []
for step in range(150):
    x, y = batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()      # DDP all-reduces (averages) the gradients here
    opt.step()
    mnb.log(step=step, loss=loss.item())
    losses.append(loss.item())
print(f"loss {losses[0]:.3f} -> {losses[-1]:.4f}")
"""),
    md("""
The four replicas are still identical: every rank gathers every other rank's parameters
and compares them bitwise.
"""),
    code(f"""
%%monarch
{CHECK}
params = [p.detach() for p in net.parameters()]
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, params)
all(torch.equal(a, b) for other in everyone for a, b in zip(other, params))
"""),
    md("And every rank's loss fell by more than a factor of ten."),
    code(f"""
%%monarch
{CHECK}
losses[-1] < losses[0] / 10
"""),
    md("""
The loss curves. `%monarch dashboard` shows the live dashboard again (a view of the same
widget: tiles per rank, the chart of `loss`, the event log). A front end without widgets
shows the status table instead, so below the curves are also drawn as text (log scale)
from the losses pulled back into the kernel.
"""),
    code("%monarch dashboard"),
    code("""
import math
curves = %monarch pull losses
BARS = "▁▂▃▄▅▆▇█"

def sparkline(values, width=50):
    # the loss on a log scale, one bar per chunk of steps
    n = -(-len(values) // width)
    pts = [math.log10(sum(c) / len(c)) for c in (values[i:i + n] for i in range(0, len(values), n))]
    lo, hi = min(pts), max(pts)
    return "".join(BARS[round((v - lo) / (hi - lo or 1) * (len(BARS) - 1))] for v in pts)

for rank, values in sorted(curves.items()):
    print(f"rank {rank}  {values[0]:6.3f} {sparkline(values)} {values[-1]:.4f}")
"""),
    code("%monarch stop"),
]

FAULT_TOLERANCE: list[Cell] = [
    md("""
# Fault tolerance: a rank dies in the middle of training

An `--elastic` cell survives a rank's death: the survivors roll back to their last
`state.commit()`, the controller respawns the dead rank and re-forms the group, the new
process takes the committed state from a live peer, and the loop carries on. With data
chosen by step, the final model is *bitwise* equal to that of a run without the fault,
which this notebook checks.
"""),
    code("""
%load_ext monarch_nb
%monarch start -n 4
"""),
    md("""
The training function lives in a `--setup` cell: setup cells are replayed on respawned
ranks, so the new process knows `train_model` too. Two details make the result bitwise
reproducible: the batch depends only on the step and the rank, and
`find_unused_parameters=True` keeps DDP's gradient buckets fixed (DDP is rebuilt inside
the loop, once per group). `pace` slows each step down a little so that there is time to
kill a rank from another cell.
"""),
    code("""
%%monarch --setup
import hashlib, time, torch, monarch_nb as mnb
from torch.nn.parallel import DistributedDataParallel as DDP

def train_model(steps=40, pace=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)

    @mnb.elastic.run(state)
    def loop(state):
        ddp = DDP(model, find_unused_parameters=True)   # bound to the current group
        while state.step < steps:
            g = torch.Generator().manual_seed(1000 * state.step + mnb.rank())
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            opt.step()
            state.step += 1
            state.commit()                              # the point a fault rolls back to
            mnb.log(step=state.step, loss=loss.item(), steps=state.step)
            time.sleep(pace)
        return state.step

    steps_run = loop()
    # a fingerprint of the parameters' exact bits: equal fingerprints, equal models
    bits = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return steps_run, hashlib.sha256(bits).hexdigest()[:16]
"""),
    md("""
First the reference: the same training without a fault. Each rank returns the number of
steps and a fingerprint of its parameters' exact bits (DDP keeps the replicas identical,
so all four agree).
"""),
    code("""
%%monarch --elastic -o clean
train_model()
"""),
    md("""
Now the same training with `--no-block`: the cell returns a handle at once and the
notebook stays free while the ranks train.
"""),
    code("""
%%monarch --elastic --no-block -o faulted
train_model(pace=0.1)
"""),
    md("""
Wait until the ranks are well into training (rank 1 has logged step 10; the `Mesh` object
behind `%monarch` answers `status()` while the cell runs), then kill rank 1 with SIGKILL,
as if its machine had gone away. `monarch_nb.chaos` does the same from inside a loop, at a
fixed step (`chaos.die_at(state.step, 10, rank=1)`).
"""),
    code("""
import time
import monarch_nb as mnb
mesh = mnb.Mesh.current()   # the mesh %monarch started, for the Python API

def steps_done(rank):
    return mesh.status()[rank]["last"].get("steps", 0)     # the last value it logged

deadline = time.monotonic() + 60
while not 10 <= steps_done(1) < 40:    # (40 is where the reference run left it)
    if time.monotonic() > deadline:
        raise RuntimeError("rank 1 did not reach step 10 within a minute")
    time.sleep(0.05)
%monarch kill 1
"""),
    md("""
`%monarch wait` blocks until the cell has finished on every rank, the respawned rank 1
included, and stores the results in `faulted`.
"""),
    code("""
%monarch wait faulted
"""),
    md("""
The faulted run ends with exactly the same parameters on every rank as the reference
(`RankResults` are dicts: rank -> (steps, fingerprint)):
"""),
    code(f"""
{CHECK}
faulted == clean
"""),
    md("""
What happened, from the mesh's event log (the dashboard shows the same): rank 1 died of
SIGKILL, was respawned as incarnation 1, and the group was re-formed (rank -1 is the mesh
itself). A survivor may be `replaced` as well: gloo does not always wake a rank whose
collective waits on another survivor, so one that has not answered the re-formation within
a few seconds gets a fresh process, which takes the state from a live peer like rank 1.
"""),
    code("""
t0 = mesh.events[0]["time"]
for e in mesh.events:
    print(f"{e['time'] - t0:6.2f} s  rank {e['rank']:>2}  inc {e['incarnation']}  {e['kind']:<10} {e['detail']}")
"""),
    code(f"""
{CHECK}
kinds = {{(e["rank"], e["kind"]) for e in mesh.events}}
(1, "died") in kinds, (1, "respawned") in kinds, (-1, "reformed") in kinds, mesh.status()[1]["incarnation"]
"""),
    md("The mesh is an ordinary mesh afterwards:"),
    code(f"""
%%monarch
{CHECK}
import torch.distributed as dist
y = torch.ones(1)
dist.all_reduce(y)
y.item()
"""),
    code("%monarch stop"),
    md("""
## Carrying on with fewer ranks, and growing back

Above, the dead rank came back. When one cannot (its restart budget is spent, respawn is
off, its host is lost with no spare host), a mesh started with `--min-ranks` carries on
with the ranks left: the group re-forms among the survivors at the smaller world size,
and the elastic loop goes on from its last commit. When capacity returns
(`%monarch restart RANK`, or `mesh.add_hosts(...)` for a lost host) the ranks join the
*running* loop at its next `state.commit()` (docs/elastic.md).

Here `--max-restarts 0` (torchrun's flag) lets no rank be respawned, so a killed rank
stays gone until it is restarted by hand. The loop
logs the world size at every step; `mnb.rank()` and `mnb.world_size()` are the torch
group's numbers (dense: 0..2 at world size 3), `mnb.mesh_rank()` the mesh's (stable).
"""),
    code("%monarch start -n 4 --max-restarts 0 --min-ranks 2 --no-dashboard"),
    code("""
%%monarch --setup
import hashlib, time, torch, torch.distributed as dist, monarch_nb as mnb

def train_elastic(steps=400, pace=0.05):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)

    @mnb.elastic.run(state)
    def loop(state):
        while state.step < steps:
            g = torch.Generator().manual_seed(1000 * state.step + mnb.rank())
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            for p in model.parameters():               # the average over the group now
                dist.all_reduce(p.grad)
                p.grad /= mnb.world_size()
            opt.step()
            state.step += 1
            state.commit()
            mnb.log(step=state.step, world=mnb.world_size(), steps=state.step)
            time.sleep(pace)

    loop()
    bits = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return mnb.world_size(), hashlib.sha256(bits).hexdigest()[:16]
"""),
    code("""
%%monarch --elastic --no-block -o grown
train_elastic()
"""),
    md("""
Once the loop is under way, rank 3 is killed. Rank 0 soon logs world size 3: the others
went on without it.
"""),
    code("""
import time
import monarch_nb as mnb
mesh = mnb.Mesh.current()

def last(rank, key):
    return mesh.status()[rank]["last"].get(key, 0)

def until(what, condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)

until("step 10 on rank 3", lambda: last(3, "steps") >= 10)
%monarch kill 3
until("world size 3", lambda: last(0, "world") == 3)
"""),
    code(f"""
{CHECK}
mesh.group, mesh.status()[3]["state"]
"""),
    md("""
Rank 3 is restarted by hand: a new process starts, and the running loop takes it back at
its next commit. `%monarch wait` then holds every rank's result: the world size it ended
at and the fingerprint of its parameters, one model on all four.
"""),
    code("%monarch restart 3"),
    code("%monarch wait grown"),
    code(f"""
{CHECK}
sizes = {{world for world, _ in grown.values()}}
models = {{fingerprint for _, fingerprint in grown.values()}}
sorted(grown), sizes, len(models)
"""),
    code("""
for e in mesh.events:
    if e["kind"] in ("died", "shrunk", "grown", "rejoined"):
        print(f"rank {e['rank']:>2}  {e['kind']:<9} {e['detail']}")
"""),
    code("%monarch stop"),
    md("""
## Surviving the kernel itself

Everything above survives the loss of a rank. A *kept* mesh also survives the loss of the
kernel: a restart to reload an edited module, or the out-of-memory killer. Its ranks belong
to this machine's host agent, which keeps them for `--keep-alive`; `%monarch attach` from
the restarted kernel (or another notebook, or a script) takes the same processes back,
with their variables and what they ran meanwhile (docs/kept-meshes.md).
"""),
    code("%monarch start -n 2 --backend cpu --no-dashboard --name ft-demo --keep-alive 5m"),
    code("""
%%monarch
weights = torch.full((3,), float(rank + 1))   # stands for a model that took long to load
"""),
    md("""
A cell that is still running when the kernel goes keeps running on the ranks. Here the
notebook lets go itself (`%monarch detach`: what a dying kernel does); after a real
restart, run `%load_ext monarch_nb` first.
"""),
    code("""
%%monarch --no-block
import time
time.sleep(2)
print("this step finished while no kernel was attached")
float(weights.sum())
"""),
    code("%monarch detach"),
    code("""
from monarch_nb import Mesh
[(m["name"], m["ranks"], m["attached"] or "detached") for m in Mesh.list()]
"""),
    code("%monarch attach ft-demo"),
    code("%monarch wait"),
    code(f"""
%%monarch
{CHECK}
float(weights.sum())   # the same processes: the weights are still there
"""),
    code("%monarch stop"),
]

DEBUGGING: list[Cell] = [
    md("""
# Debugging a mesh: a hung collective, post-mortem, logs

Everything here works while the ranks are stuck, because each rank's control thread (not
its main thread, which runs your code) answers the notebook.
"""),
    code("""
%load_ext monarch_nb
%monarch start -n 4 --no-dashboard
"""),
    md("""
## A hung collective

Rank 3 never calls the `all_reduce` the other three wait in, so the cell would never
finish. Run it with `--no-block`: the notebook stays free to look at the ranks.
"""),
    code("""
%%monarch --no-block -o hung
import time, torch, torch.distributed as dist, monarch_nb as mnb

def waiting_for_peer():
    x = torch.ones(1)
    dist.all_reduce(x)   # returns only when all four ranks have called it

def stuck_here():
    time.sleep(600)      # rank 3 never gets to the all_reduce

if mnb.rank() == 3:
    stuck_here()
else:
    waiting_for_peer()
"""),
    md("""
`%monarch stacks` shows where every thread of every rank is, grouped: ranks standing in the
same place are shown once, with a summary line naming the collective and the cell line
that called it. (The loop first waits until the three ranks have reached the collective;
`mesh` is the `Mesh` object behind `%monarch`, with the same methods.)
"""),
    code("""
import time
import monarch_nb as mnb
mesh = mnb.Mesh.current()   # the mesh %monarch started

deadline = time.monotonic() + 60
while not (len(mesh.stacks().groups()) == 2 and mesh.stacks()[0].collective()):
    if time.monotonic() > deadline:
        raise RuntimeError("the ranks did not settle within a minute")
    time.sleep(0.2)
%monarch stacks
"""),
    md("The summary and the hint on their own:"),
    code(f"""
{CHECK}
stacks = mesh.stacks()
print("\\n".join(stacks.summary()))
print("hint:", stacks.hint())
"""),
    md("""
Cancel the cell (`hung.cancel()` interrupts the ranks still running it, like the stop button
of a blocking cell). Ranks interrupted inside a collective have left the group out of step
(their `all_reduce` was abandoned half-way), so give them fresh processes with
`%monarch restart all`: same ranks and devices, a new `torch.distributed` group, `--setup`
cells replayed.
"""),
    code(f"""
{CHECK}
hung.cancel()
"""),
    code("%monarch restart all"),
    code(f"""
%%monarch
{CHECK}
import torch, torch.distributed as dist, monarch_nb as mnb
x = torch.ones(1)
dist.all_reduce(x)
x.item()
"""),
    md("""
## Which rank, which collective: the flight recorder

Every rank records its last 2,000 `torch.distributed` collectives and point-to-point ops
(op, group, sequence number, tensor shapes and dtypes, the cell line that called it, its
state), at about a microsecond per call. `%monarch collectives` (`mesh.collectives()`)
lines the ranks' records up per group and says where they part. A deliberate desync: on
rank 3 one step of the loop makes one all_reduce too many, so rank 3 ends up waiting in a
collective nobody else will call.
"""),
    code("""
%%monarch --no-block -o desync
for step in range(4):
    x = torch.ones(4)
    dist.all_reduce(x)
    if mnb.rank() == 3 and step == 1:
        dist.all_reduce(torch.ones(4))   # one extra, on one rank
"""),
    md("""
Ranks 0-2 finish the cell; rank 3 is stuck. The summary names the collective rank 3 waits
in, where the others are, and the first collective where the ranks' calls came from
different lines (the same op and shape, so nothing failed: the counts just drifted apart).
The hang watchdog and `%monarch stacks` print the same lines first; the dashboard shows
them as a badge.
"""),
    code(f"""
{CHECK}
def settled():   # rank 3 in its extra all_reduce, ranks 0-2 out of the cell
    found = mesh.collectives().findings
    return [f.kind for f in found] == ["missing", "diverged"] and "idle" in found[0].text

deadline = time.monotonic() + 60
while not settled():
    if time.monotonic() > deadline:
        raise RuntimeError("rank 3 did not get stuck within a minute")
    time.sleep(0.2)
print("\\n".join(mesh.collectives().summary()))
"""),
    md("""
Here the cure is to let ranks 0-2 make the call rank 3 waits in: the counts agree again
and the group stays usable.
"""),
    code(f"""
{CHECK}
mesh.ranks("0-2").exec("dist.all_reduce(torch.ones(4))")
desync.result(timeout=60)
mesh.collectives().ok
"""),
    md("""
Strict mode (`--check-collectives`, `check_collectives=True`) compares each collective's op,
shapes and dtypes across the ranks *before* it runs, as `TORCH_DISTRIBUTED_DEBUG=DETAIL`
does, and fails the cell at once on every rank instead of hanging or returning garbage.
Rank 3 passes the wrong shape:
"""),
    code("""
%%monarch --check-collectives
x = torch.ones(8 if mnb.rank() != 3 else 4)
dist.all_reduce(x)
""", "raises-exception"),
    md("Nothing was sent, so the group is still in step:"),
    code(f"""
%%monarch
{CHECK}
x = torch.ones(1)
dist.all_reduce(x)
x.item()
"""),
    md("""
`%monarch stragglers` (`mesh.stragglers()`) splits each rank's time into computing and
waiting in collectives and flags a rank that is consistently slower than the others;
`%monarch trace PATH` (`mesh.trace(path)`) writes the session's cells, collectives, steps,
deaths and respawns as a Chrome/Perfetto trace.

## The hang watchdog

A cell that makes no progress (no output, no metric, no rank returning) for
`--hang-timeout` seconds gets the grouped stacks printed into it, once, with a hint. Here
rank 2 is only late: the cell still completes.
"""),
    code("""
%%monarch --hang-timeout 2
import time

def late_joiner():
    time.sleep(5)

if mnb.rank() == 2:
    late_joiner()
y = torch.ones(1)
dist.all_reduce(y)
y.item()
"""),
    md("""
## Post-mortem

A cell fails on rank 2 (`scale(4)` divides by zero there) ...
"""),
    code("""
%%monarch
def scale(x):
    y = x - 4
    return x / y

scale(mnb.rank() + 2)
""", "raises-exception"),
    md("""
... and `%monarch debug 2` opens `pdb` on rank 2's exception, in the frame that raised it.
Interactively, each `[rank 2] (Pdb)` prompt is the notebook's input box: type `p x, y`,
`where`, `up`, `list`, and `q` to leave. A notebook run headless (nbval, `make demo`) has
no input box, so here the answers are scripted by standing in for `input()`; each prompt
is printed with the answer given.
"""),
    code(f"""
{CHECK}
from unittest import mock

answers = iter(["p x, y", "q"])

def typed(prompt):
    answer = next(answers)
    print(prompt + answer, flush=True)
    return answer

with mock.patch("builtins.input", typed):
    %monarch debug 2
"""),
    md("The rank keeps its state and takes calls afterwards:"),
    code(f"""
%%monarch --ranks 2
{CHECK}
scale.__name__, scale(6)
"""),
    md("""
## Logs

`%monarch logs RANK` shows a rank's recent output, earlier incarnations of a respawned rank
included (each under a header saying how it ended).
"""),
    code("""
%%monarch --ranks 1
print("a line for the log")
"""),
    code("%monarch logs 1 --tail 8"),
    code("%monarch stop"),
]

BACKENDS: list[Cell] = [
    md("""
# Backends: cuda, rocm or cpu

`%monarch start --backend auto` (the default) looks at the installed torch build and the
GPUs it sees: a CUDA build with GPUs gives NCCL ranks, one GPU each; a ROCm build with GPUs
gives RCCL ranks (torch calls it `nccl` too); anything else gives CPU ranks joined by
gloo. This machine has no GPU, so everything below runs on the CPU; the pinning rules are
shown with `monarch_nb.backends`' pure functions, which need no GPU.
"""),
    md("""
The torch build is read from `torch/version.py` without importing torch (so starting a CPU
mesh does not cost the kernel an `import torch`):
"""),
    code("""
from monarch_nb import backends
backends.torch_build()
"""),
    md("What `auto` picks here:"),
    code(f"""
{CHECK}
info = backends.resolve("auto")
info.name, info.dist_backend, info.devices
"""),
    md("Asking for a backend this build cannot do is a clear error, not a hang:"),
    code("""
backends.resolve("cuda")
""", "raises-exception"),
    md("""
## Device pinning

Each rank's environment is restricted to its one device *before* its interpreter starts,
so torch in the rank only ever sees one GPU (as `cuda:0`). The devices are those the
kernel may use: with `CUDA_VISIBLE_DEVICES=4,5,6,7` in the kernel's environment, four
ranks get GPUs 4 to 7.
"""),
    code(f"""
{CHECK}
cuda = backends.BackendInfo("cuda", "nccl", "2.x", devices=("4", "5", "6", "7"))
for local_rank in range(4):
    env = {{"CUDA_VISIBLE_DEVICES": "4,5,6,7"}}
    backends.pin_env(cuda, local_rank, env)
    print(local_rank, env)
"""),
    md("""
On ROCm, HIP honours `CUDA_VISIBLE_DEVICES` and `ROCR_VISIBLE_DEVICES` as well, and setting
several would filter twice: a rank gets `HIP_VISIBLE_DEVICES` alone.
"""),
    code(f"""
{CHECK}
rocm = backends.BackendInfo("rocm", "nccl", "2.x", devices=("0", "1"))
env = {{"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0,1"}}
backends.pin_env(rocm, 1, env)
env
"""),
    md("A CPU mesh hides GPUs that happen to be present, so CPU ranks never touch them:"),
    code(f"""
{CHECK}
env = {{}}
backends.pin_env(backends.BackendInfo("cpu", "gloo", "2.x"), 0, env)
env
"""),
    md("More ranks than GPUs is refused with what to do instead:"),
    code("""
backends.pin_env(cuda, 4, {})
""", "raises-exception"),
    md("""
## The ranks' view

A real mesh on this machine: each rank's device, what it sees of CUDA, and its
process-group backend.
"""),
    code("""
%load_ext monarch_nb
%monarch start -n 4 --no-dashboard
"""),
    code(f"""
%%monarch
{CHECK}
import os, torch, torch.distributed as dist, monarch_nb as mnb
str(mnb.device()), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available(), dist.get_backend()
"""),
    md("""
## What changes on a GPU box

- `%monarch start` without `-n` starts one rank per visible GPU (here: `min(4, cores)` CPU
  ranks). `-n` larger than the number of GPUs is refused, as above.
- Rank *r* gets `CUDA_VISIBLE_DEVICES` (or `HIP_VISIBLE_DEVICES`) set to the *r*-th visible
  GPU, so `mnb.device()` is `cuda:0` in every rank, and the status table and the
  dashboard show each rank's GPU memory, utilisation, temperature and power (NVML with
  `pip install monarch-nb[nvidia]`, amdsmi with `monarch-nb[rocm]`).
- The process group is NCCL (RCCL on ROCm) instead of gloo; the cells of these notebooks
  run unchanged, since they put tensors on `mnb.device()`.
- `--backend cpu` still gives CPU ranks on a GPU box, with the GPUs hidden from them.
"""),
    code("%monarch status"),
    code("%monarch stop"),
]

NOTEBOOKS: dict[str, list[Cell]] = {
    "01_quickstart": QUICKSTART,
    "02_ddp_training": DDP_TRAINING,
    "03_fault_tolerance": FAULT_TOLERANCE,
    "04_debugging": DEBUGGING,
    "05_backends": BACKENDS,
}
