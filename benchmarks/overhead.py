"""Wall time of lightning_fl against a hand-written PyTorch FedAvg loop, same process.

    python benchmarks/overhead.py [--workloads mlp cnn] [--repeats 3]

Both sides use the same data, the same DataLoader per client (batch 32, reshuffled every
pass), the same uniformly sampled 10 of 100 clients per round, 10 local SGD steps at
lr 0.05, equal-weight server averaging and 20 rounds, on one thread. Prints the median
of ``repeats`` runs of each and their ratio (lightning_fl / hand-written).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fl import MLP, Classifier, FederatedStrategy, MnistCNN, UniformSampler
from lightning_fl.callbacks import FedAvg
from lightning_fl.datamodules import InMemoryFederatedDataModule

CLIENTS, PER_ROUND, ROUNDS, STEPS, BATCH, LR = 100, 10, 20, 10, 32, 0.05


def mlp_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(60, 10, generator=g)
    data = []
    for _ in range(CLIENTS):
        x = torch.randn(320, 60, generator=g)
        y = (x @ w + 0.5 * torch.randn(320, 10, generator=g)).argmax(1)
        data.append((x, y))
    return data


def cnn_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    templates = torch.randn(10, 1, 28, 28, generator=g)
    data = []
    for _ in range(CLIENTS):
        y = torch.randint(0, 10, (200,), generator=g)
        data.append((templates[y] + torch.randn(200, 1, 28, 28, generator=g), y))
    return data


WORKLOADS = {
    "mlp": (mlp_data, lambda: MLP(60, (128,), 10)),
    "cnn": (cnn_data, lambda: MnistCNN(10)),
}


class BareClassifier(Classifier):
    """Classifier whose training_step only returns the loss (no ``self.log`` per step)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def run_lightning_fl(data, make_net, module_cls=Classifier) -> float:
    torch.manual_seed(0)
    module = module_cls(network=make_net(), lr=LR)
    dm = InMemoryFederatedDataModule([{"train": d} for d in data], batch_size=BATCH)
    trainer = pl.Trainer(
        max_epochs=ROUNDS,
        accelerator="cpu",
        strategy=FederatedStrategy(sampler=UniformSampler(PER_ROUND), local_steps=STEPS, seed=0),
        callbacks=[FedAvg(weighting="uniform")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    return time.perf_counter() - start


def run_hand_written(data, make_net) -> float:
    torch.manual_seed(0)
    net: nn.Module = make_net()
    start = time.perf_counter()
    global_state = [p.detach().clone() for p in net.parameters()]
    rng = torch.Generator().manual_seed(0)
    for _ in range(ROUNDS):
        clients = torch.randperm(CLIENTS, generator=rng)[:PER_ROUND].tolist()
        new_state = [torch.zeros_like(p) for p in global_state]
        for c in clients:
            with torch.no_grad():
                for p, g in zip(net.parameters(), global_state):
                    p.copy_(g)
            optimizer = torch.optim.SGD(net.parameters(), lr=LR)
            loader = DataLoader(TensorDataset(*data[c]), batch_size=BATCH, shuffle=True)
            steps = 0
            while steps < STEPS:
                for x, y in loader:
                    optimizer.zero_grad()
                    F.cross_entropy(net(x), y).backward()
                    optimizer.step()
                    steps += 1
                    if steps == STEPS:
                        break
            for s, p in zip(new_state, net.parameters()):
                s += p.detach() / PER_ROUND
        global_state = new_state
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.workloads:
        make_data, make_net = WORKLOADS[name]
        data = make_data()
        ours, bare, ref = [], [], []
        for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
            ref.append(run_hand_written(data, make_net))
            ours.append(run_lightning_fl(data, make_net))
            bare.append(run_lightning_fl(data, make_net, BareClassifier))
        ref_s = statistics.median(ref)
        for label, times in (("Classifier, logging", ours), ("bare module", bare)):
            ours_s = statistics.median(times)
            print(
                f"{name}: lightning_fl ({label}) {ours_s:.3f} s, hand-written {ref_s:.3f} s, "
                f"ratio {ours_s / ref_s:.3f} (median of {args.repeats})",
                flush=True,
            )


if __name__ == "__main__":
    main()
