"""pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py, on CPU.

The tutorial's script as a user would bring it to ``python -m monarch_nb.launch``
(or torchrun): gloo instead of nccl, the rank from ``RANK``/``LOCAL_RANK``
instead of a GPU id, no snapshot file (a rank that runs the script again
starts from epoch 0, as the tutorial's does without a snapshot).

Fault hook for the tests, off unless set: ``DDP_TUTORIAL_KILL="RANK:E0,E1,..."``
SIGKILLs rank RANK at the start of epoch E0 in its first process, at E1 in
the process that replaced it, and so on (incarnation i dies at epoch Ei).

    python -m monarch_nb.launch -n 2 --backend cpu tests/scripts/ddp_tutorial.py 10 5
"""

from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size
        gen = torch.Generator().manual_seed(0)  # the same data on every rank
        self.data = [(torch.rand(20, generator=gen), torch.rand(1, generator=gen))
                     for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


def _fault_hook(epoch: int) -> None:
    spec = os.environ.get("DDP_TUTORIAL_KILL", "")
    if not spec:
        return
    rank, _, epochs = spec.partition(":")
    if int(os.environ["RANK"]) != int(rank):
        return
    import monarch_nb as mnb

    at = [int(e) for e in epochs.split(",") if e]
    incarnation = mnb.incarnation()
    if incarnation < len(at) and epoch == at[incarnation]:
        print(f"[CPU{rank}] killing myself at epoch {epoch} (incarnation {incarnation})",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader,
                 optimizer: torch.optim.Optimizer, save_every: int) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.model = DDP(self.model)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[CPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            _fault_hook(epoch)
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                print(f"Epoch {epoch} | (snapshot not kept on CPU)", flush=True)


def load_train_objs() -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(256)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every)
    trainer.train(total_epochs)
    print(f"[CPU{trainer.global_rank}] training finished after {total_epochs} epochs",
          flush=True)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
