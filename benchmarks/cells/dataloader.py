# A training loop over a DataLoader with worker processes and an all_reduce per
# step, written as a user would write a `%%monarch --elastic` cell
# (benchmarks/recovery.py sends it with mesh.exec(..., elastic=True)). Each rank
# keeps `done`: (step, wall-clock time) of every step it finished, so the gap a
# kill leaves can be read afterwards (mesh.pull("done")).
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import monarch_nb as mnb

data = TensorDataset(torch.arange(64 * 1000, dtype=torch.float32))
steps = 400
state = mnb.elastic.State(step=0)
done = []


@mnb.elastic.run(state)
def train(state):
    while state.step < steps:
        for (x,) in DataLoader(data, batch_size=64, num_workers=2):
            total = x.sum()
            dist.all_reduce(total)
            time.sleep(0.02)  # the step's compute
            state.step += 1
            state.commit()
            done.append((state.step, time.time()))
            mnb.log(step=state.step, total=total.item())
            if state.step >= steps:
                break


train()
