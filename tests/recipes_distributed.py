"""Recipes on 2 processes, one after another in one torchrun launch (run by
tests/test_distributed.py): each case is ``lightning-fl fit`` with its arguments and
``--trainer.devices 2``, in its own folder ``<root>/<case>``. One launch pays Python's and
Lightning's start-up once for all cases instead of once per process and case. Rank 0 writes
every case's outcome (``ok`` or the error's message) to ``<root>/outcomes.json``.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.recipes_distributed ROOT CASES

``CASES`` is a JSON file ``{case: [arguments]}``; an argument ``@last.ckpt:<case>`` stands
for that earlier case's last checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch.distributed as dist

from lightning_fl.cli import run, short_message
from tests.helpers import ACCELERATOR


def run_file(folder: str | os.PathLike, name: str) -> str:
    """The one file ``name`` a run wrote under ``folder`` (its version folder varies)."""
    (path,) = glob.glob(os.path.join(folder, "**", name), recursive=True)
    return path


def case_arguments(root: str, case: str, arguments: list[str]) -> list[str]:
    folder = os.path.join(root, case)
    resolved = [
        run_file(os.path.join(root, a.split(":", 1)[1]), "last.ckpt")
        if a.startswith("@last.ckpt:")
        else a
        for a in arguments
    ]
    return ["fit", *resolved, "--trainer.devices", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", folder, "--trainer.logger.init_args.save_dir", folder,
            "--trainer.strategy.init_args.timeout", "120",
            "--trainer.accelerator", ACCELERATOR]  # fmt: skip


if __name__ == "__main__":
    root, cases_file = sys.argv[1], sys.argv[2]
    with open(cases_file) as handle:
        cases = json.load(handle)
    outcomes = {}
    for case, arguments in cases.items():
        try:
            run(case_arguments(root, case, arguments), exit_on_error=False)
            outcomes[case] = "ok"
        except Exception as err:  # noqa: BLE001 - reported; the test decides
            outcomes[case] = short_message(err)
        dist.barrier()  # rank 0's checkpoint is on disk before a later case reads it
    if dist.get_rank() == 0:
        with open(os.path.join(root, "outcomes.json"), "w") as handle:
            json.dump(outcomes, handle)
    dist.barrier()
    dist.destroy_process_group()
