"""Every plugin of the composition matrix on 2 processes, and the pairs whose client state
moves between ranks (run under torchrun by tests/test_composition.py): rank 0 saves each
run's outcome, by name (``A+B`` for a pair), to the file given."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests import composition

if __name__ == "__main__":
    composition.quiet()
    names = sys.argv[2:] or composition.DISTRIBUTED_RUNS
    results = {}
    for name in names:
        outcome = composition.run(tuple(name.split("+")))
        results[name] = {"status": outcome.status, "message": outcome.message,
                         "params": outcome.params, "metrics": outcome.metrics}  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
