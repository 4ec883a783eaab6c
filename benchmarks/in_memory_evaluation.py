"""A full validation pass over many in-memory clients (issue 78, item 4): an
``InMemoryFederatedDataModule`` of plain tensors packs itself into arrays with offsets
(``split_arrays``) and takes the vectorized evaluation path, against the client-by-client
path it took before (the same datamodule with a ``client_dataset`` of its own, which keeps
it off the arrays), in the same run.

    python benchmarks/in_memory_evaluation.py [--clients 100000] [--repeats 3]

N clients of 4 validation samples (16 features, 4 classes), an MLP 16-32-4,
``eval_batch_size=64``, ``vectorize_evaluation="auto"``, one CPU thread; the time of
``Trainer.validate`` (the packing of the split included: the first pass packs it), median
of ``--repeats`` interleaved runs, and the two runs' metrics side by side (they must
agree). Writes benchmarks/results/in_memory_evaluation.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_fl import MLP, Classifier, FederatedStrategy
from lightning_fl.datamodules import InMemoryFederatedDataModule

RESULTS = Path(__file__).resolve().parent / "results" / "in_memory_evaluation.md"


class ClientByClient(InMemoryFederatedDataModule):
    """The same clients, with datasets of its own: no arrays (the path before issue 78)."""

    def client_dataset(self, client, split):
        return super().client_dataset(client, split)


def clients(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n * 8, 16, generator=g), torch.randint(0, 4, (n * 8,), generator=g)
    return [{"train": (x[8 * c : 8 * c + 4], y[8 * c : 8 * c + 4]),
             "val": (x[8 * c + 4 : 8 * c + 8], y[8 * c + 4 : 8 * c + 8])}
            for c in range(n)]  # fmt: skip


def validate(kind: type, n: int) -> tuple[float, dict[str, float]]:
    dm = kind(clients(n), batch_size=4, eval_batch_size=64)
    torch.manual_seed(0)
    module = Classifier(MLP(16, (32,), 4), lr=0.1)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            strategy=FederatedStrategy(local_steps=1, seed=0, enable_plots=False),
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", default_root_dir=root,
        )  # fmt: skip
        start = time.perf_counter()
        metrics = trainer.validate(module, datamodule=dm, verbose=False)[0]
        return time.perf_counter() - start, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_fl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    times: dict[str, list[float]] = {"client by client": [], "arrays (packed)": []}
    metrics = {}
    for _ in range(args.repeats):  # interleaved: the machine's noise falls on both
        for label, kind in (("client by client", ClientByClient),
                            ("arrays (packed)", InMemoryFederatedDataModule)):  # fmt: skip
            seconds, metrics[label] = validate(kind, args.clients)
            times[label].append(seconds)
    before, after = (statistics.median(times[k]) for k in times)
    rows = [
        f"# A full validation pass over {args.clients:,} in-memory clients of 4 samples",
        "",
        "`python benchmarks/in_memory_evaluation.py` (one CPU thread, median of "
        f"{args.repeats} interleaved runs).",
        "",
        "| path | s | ratio | val_loss | val_acc |",
        "|---|---|---|---|---|",
    ]
    for label in times:
        m = metrics[label]
        rows.append(f"| {label} | {statistics.median(times[label]):.2f} | "
                    f"{statistics.median(times[label]) / before:.3f} | {m['val_loss']:.6f} | "
                    f"{m['val_acc']:.6f} |")  # fmt: skip
    text = "\n".join(rows) + f"\n\nSpeed-up: {before / after:.1f}×.\n"
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
