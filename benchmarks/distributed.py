"""The core benchmark's "cnn" workload on 1 and on 2 processes (gloo on CPU).

    python benchmarks/distributed.py [--devices 1 2] [--rounds 20] [--repeats 3]

Each run is a fresh ``python benchmarks/distributed.py --worker --devices N`` (Lightning's
launcher starts the other ranks). It prints the wall time of the training rounds (from
``on_train_start`` to ``on_train_end`` on rank 0: process start-up and set-up excluded),
the speed-up against 1 process and the simulated clients per second (clients trained /
wall time). Both runs use one thread per process.

``--profile``: where each rank's time goes (issue 25 item 4): seconds in its own clients'
steps, in idle (padding) steps while the other rank trains, and in the round's end (the
all-reduce and aggregation, which waits for the slowest rank), the steps each rank trained,
and the mean over rounds of max/mean of the clients per rank under the owner split
(1 = balanced). ``--by-owner`` trains every client on its owner rank (client %
world_size), the split before participants were balanced by steps. ``--vectorize``: the
same workload with ``FederatedStrategy(vectorize=True)``, each rank stacking its own share
of the round's clients (not with ``--profile``, whose per-step hooks count client steps).
``--scaffold``: with SCAFFOLD, whose control variates c_i live in the client store and move
to the rank that trains the client for the round (``--by-owner``: the owner split, which
such runs used before the state moved).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(
    devices: int, rounds: int, profile: bool = False, by_owner: bool = False,
    vectorize: bool = False, scaffold: bool = False,
) -> None:  # fmt: skip
    import lightning.pytorch as pl
    import torch
    from overhead import BATCH, LR, PER_ROUND, STEPS, cnn_data

    from lightning_fl import Classifier, FederatedStrategy, MnistCNN, UniformSampler
    from lightning_fl.callbacks import SCAFFOLD, FedAvg
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

    if by_owner:  # the split before issue 25: every client trains on client % world_size
        from lightning_fl.engine.planning import RoundPlanner

        RoundPlanner.balanced = lambda self: False

    class RankProfile(pl.Callback):
        """Seconds per rank in its clients' steps, in idle steps and in the round's end."""

        def __init__(self) -> None:
            self.busy = self.idle = self.end = 0.0
            self.steps, self.imbalance = 0, []

        def setup(self, trainer, pl_module, stage) -> None:
            engine = trainer.strategy.engine
            end_round = engine.end_round

            def timed_end_round(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return end_round(*args, **kwargs)
                finally:
                    self.end += time.perf_counter() - start

            engine.end_round = timed_end_round

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self._last = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start, self._end_before = time.perf_counter(), self.end

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            plan = trainer.strategy.current_round
            pos = plan.schedule.locate(batch_idx)[0]
            # the round's end may run inside this batch's hooks: counted apart
            seconds = time.perf_counter() - self._start - (self.end - self._end_before)
            if plan.is_padding(pos):
                self.idle += seconds
            else:
                self.busy += seconds
                self.steps += 1
            if batch_idx == 0:
                per_rank = [0] * trainer.world_size
                for c in plan.state.participation.clients:
                    per_rank[trainer.strategy.owner(c)] += 1
                self.imbalance.append(max(per_rank) / (sum(per_rank) / len(per_rank)))

        def on_train_end(self, trainer, pl_module) -> None:
            mean = sum(self.imbalance) / max(len(self.imbalance), 1)
            print(f"RANK {trainer.global_rank}: own steps {self.busy:.2f} s ({self.steps} "
                  f"steps), idle steps {self.idle:.2f} s, round ends {self.end:.2f} s; "
                  f"owner split's clients max/mean {mean:.2f}", flush=True)  # fmt: skip

    extra = [RankProfile()] if profile else []
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator="cpu", devices=devices,
        strategy=FederatedStrategy(sampler=UniformSampler(PER_ROUND), local_steps=STEPS, seed=0,
                                   vectorize=vectorize),
        callbacks=[FedAvg(weighting="uniform"), RoundsTimer(), *extra,
                   *([SCAFFOLD()] if scaffold else [])], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--repeats", type=int, default=1, help="interleaved runs per process count (median)"
    )
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--profile", action="store_true", help="where each rank's time goes")
    parser.add_argument(
        "--by-owner", action="store_true", help="train every client on its owner rank"
    )
    parser.add_argument("--vectorize", action="store_true", help="vectorized clients per rank")
    parser.add_argument("--scaffold", action="store_true", help="with SCAFFOLD's client state")
    args = parser.parse_args()
    if args.vectorize and args.profile:
        parser.error("--profile counts sequential client steps; drop it with --vectorize.")
    if args.worker:
        worker(args.devices[0], args.rounds, args.profile, args.by_owner, args.vectorize,
               args.scaffold)  # fmt: skip
        return
    from overhead import PER_ROUND

    runs: dict[int, list[float]] = {n: [] for n in args.devices}
    for _ in range(args.repeats):  # interleaved: the host's drift hits every count alike
        for n in args.devices:
            command = [sys.executable, __file__, "--worker", "--devices", str(n)]
            command += ["--profile"] if args.profile else []
            command += ["--by-owner"] if args.by_owner else []
            command += ["--vectorize"] if args.vectorize else []
            command += ["--scaffold"] if args.scaffold else []
            out = subprocess.run(
                [*command, "--rounds", str(args.rounds)], capture_output=True, text=True,
                check=True,
            ).stdout  # fmt: skip
            runs[n].append(float(re.search(r"FIT_SECONDS ([\d.]+)", out).group(1)))
            for line in sorted(set(re.findall(r"RANK \d+: .*", out))):
                print(f"  {n} process(es), {line}", flush=True)
            print(f"  {n} process(es), run {len(runs[n])}: {runs[n][-1]:.3f} s", flush=True)
    times = {n: statistics.median(runs[n]) for n in args.devices}
    for n in args.devices:
        clients_per_s = PER_ROUND * args.rounds / times[n]
        speedup = times[args.devices[0]] / times[n]
        print(
            f"cnn{', vectorized' if args.vectorize else ''}"
            f"{', SCAFFOLD' if args.scaffold else ''}, {n} process(es): "
            f"{times[n]:.3f} s (median of {args.repeats}), speed-up {speedup:.2f}x, "
            f"{clients_per_s:.2f} clients/s ({PER_ROUND} clients x {args.rounds} rounds)",
            flush=True,
        )


if __name__ == "__main__":
    main()
