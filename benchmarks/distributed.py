"""The core benchmark's "cnn" workload on 1 and on 2 processes (gloo on CPU).

    python benchmarks/distributed.py [--devices 1 2] [--rounds 20]

Each run is a fresh ``python benchmarks/distributed.py --worker --devices N`` (Lightning's
launcher starts the other ranks). It prints the wall time of the training rounds (from
``on_train_start`` to ``on_train_end`` on rank 0: process start-up and set-up excluded),
the speed-up against 1 process and the simulated clients per second (clients trained /
wall time). Both runs use one thread per process.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(devices: int, rounds: int) -> None:
    import lightning.pytorch as pl
    import torch
    from overhead import BATCH, LR, PER_ROUND, STEPS, cnn_data

    from lightning_fl import Classifier, FederatedStrategy, MnistCNN, UniformSampler
    from lightning_fl.callbacks import FedAvg
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    class RoundsTimer(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                print(f"FIT_SECONDS {time.perf_counter() - self.start:.3f}", flush=True)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = Classifier(network=MnistCNN(10), lr=LR)
    dm = InMemoryFederatedDataModule([{"train": d} for d in cnn_data()], batch_size=BATCH)
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator="cpu", devices=devices,
        strategy=FederatedStrategy(sampler=UniformSampler(PER_ROUND), local_steps=STEPS, seed=0),
        callbacks=[FedAvg(weighting="uniform"), RoundsTimer()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.devices[0], args.rounds)
        return
    from overhead import PER_ROUND

    times = {}
    for n in args.devices:
        command = [sys.executable, __file__, "--worker", "--devices", str(n)]
        out = subprocess.run(
            [*command, "--rounds", str(args.rounds)], capture_output=True, text=True, check=True
        ).stdout
        times[n] = float(re.search(r"FIT_SECONDS ([\d.]+)", out).group(1))
        clients_per_s = PER_ROUND * args.rounds / times[n]
        speedup = times[args.devices[0]] / times[n]
        print(
            f"cnn, {n} process(es): {times[n]:.3f} s, speed-up {speedup:.2f}x, "
            f"{clients_per_s:.2f} clients/s ({PER_ROUND} clients x {args.rounds} rounds)",
            flush=True,
        )


if __name__ == "__main__":
    main()
