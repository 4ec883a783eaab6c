"""``lightning-fl data``: large federations on disk (:mod:`lightning_fl.datamodules.arrays`).

    lightning-fl data generate --shape sent140 --clients 660120 --out data/sent140_like
    lightning-fl data generate-leaf --shape reddit --clients 5000 --out data/reddit_json
    lightning-fl data convert-leaf data/reddit_json --out data/reddit_like
    lightning-fl data convert-leaf data/femnist/train --test data/femnist/test \
        --dataset femnist --out data/femnist_fed
    lightning-fl data info data/sent140_like

``generate`` writes a generated LEAF-shaped population straight into the on-disk format
(train, validation and test splits: ``--val-fraction`` 0.1 and ``--test-fraction`` 0.2 of
each client's samples, so that ``eval_clients`` has clients to evaluate);
``generate-leaf`` writes the same population as LEAF JSON files; ``convert-leaf`` reads
LEAF JSON (files or folders) user by user and writes the on-disk format once; ``info``
opens a folder (checking every file) and prints its shape. A recipe then reads the folder
with ``ArrayFederatedDataModule(path=...)``.
"""

from __future__ import annotations

import argparse
import sys
import time

#: LEAF datasets the converter encodes (datamodules/leaf_convert.py, imported late: torch)
DATASETS = ("synthetic", "femnist", "shakespeare", "sent140")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="lightning-fl data", description="Large federations on disk (issue 66)."
    )
    commands = root.add_subparsers(dest="command", required=True)
    for name, what in (("generate", "an on-disk federation"), ("generate-leaf", "LEAF JSON")):
        sub = commands.add_parser(name, help=f"a generated LEAF-shaped population as {what}")
        sub.add_argument("--shape", choices=("sent140", "reddit"), default="sent140")
        sub.add_argument("--clients", type=int, required=True, help="number of clients N")
        sub.add_argument("--features", type=int, default=4)
        sub.add_argument("--classes", type=int, default=2)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--out", required=True, help="the folder to write")
        if name == "generate":
            sub.add_argument("--val-fraction", type=float, default=0.1,
                             help="each client's share of validation samples")  # fmt: skip
            sub.add_argument("--test-fraction", type=float, default=0.2,
                             help="each client's share of test samples")  # fmt: skip
    convert = commands.add_parser("convert-leaf", help="LEAF JSON into the on-disk format")
    convert.add_argument("train", nargs="+", help="training .json files or folders of them")
    convert.add_argument("--test", nargs="+", help="test .json files or folders of them")
    convert.add_argument("--dataset", default="synthetic", choices=DATASETS,
                         help="how x and y are encoded (LeafDataModule's encoding)")  # fmt: skip
    convert.add_argument("--max-words", type=int, default=25, help="Sent140's sequence length")
    convert.add_argument("--out", required=True, help="the federation folder to write")
    info = commands.add_parser("info", help="check a federation folder and print its shape")
    info.add_argument("folder")
    return root


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    from lightning_fl.datamodules import arrays, leaf_convert, population

    start = time.perf_counter()
    try:
        if args.command == "generate":
            folder = population.generate_population(
                args.out, args.clients, args.shape, args.features, args.classes,
                test_fraction=args.test_fraction, seed=args.seed, val_fraction=args.val_fraction,
            )  # fmt: skip
        elif args.command == "generate-leaf":
            files = population.write_leaf_population(
                args.out, args.clients, args.shape, args.features, args.classes, seed=args.seed
            )
            print(f"{len(files)} LEAF JSON file(s) in {args.out} "
                  f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
            return
        elif args.command == "convert-leaf":
            folder = leaf_convert.convert_leaf(
                args.train, args.out, args.test, args.dataset, args.max_words
            )
        else:
            folder = args.folder
        splits = arrays.open_federation(folder)
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-fl data: {args.command} did not complete.", file=sys.stderr)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for split, data in splits.items():
        print(f"{folder}: {split}: {population.shape_summary(data.counts)}")
    print(f"({time.perf_counter() - start:.1f} s)")
