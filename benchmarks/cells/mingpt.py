# A minGPT-style character model trained with DDP over gloo, written as a user
# would write a `%%monarch --elastic` cell (benchmarks/recovery.py sends it with
# mesh.exec(..., elastic=True)).
# Each rank keeps `records`: one line per finished epoch, with its time and the
# rank's torch thread count, so a respawned rank's speed shows in the figures.
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import monarch_nb as mnb

text = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? ") * 200
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text])
block, batch = 64, 16
epochs, steps = 8, 12  # steps per epoch: ~1-3 s an epoch on 2 busy cores


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        causal = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d=128, heads=4, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        return self.head(self.blocks(x))


torch.manual_seed(0)
model = GPT(len(chars))
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
state = mnb.elastic.State(model=model, optimizer=opt, epoch=0)
records = []


@mnb.elastic.run(state)
def train(state):
    ddp = DDP(model)  # bound to the current group: built inside, rebuilt after a fault
    while state.epoch < epochs:
        t = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * state.epoch + mnb.rank())
        for _ in range(steps):
            ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
            x = torch.stack([data[i:i + block] for i in ix])
            y = torch.stack([data[i + 1:i + block + 1] for i in ix])
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        state.epoch += 1
        state.commit()
        records.append({"epoch": state.epoch, "s": time.perf_counter() - t, "pid": os.getpid(),
                        "threads": torch.get_num_threads(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")})
        mnb.log(step=state.epoch, loss=loss.item(), threads=torch.get_num_threads())


train()
