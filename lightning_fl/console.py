"""The console of every lightning_fl run, command line or script (issue 38): Lightning's
tips, accelerator lines and seed line off; warnings that every run would print and that say
nothing about this run filtered. Light: importing it imports neither torch nor Lightning."""

from __future__ import annotations

import logging
import os
import warnings

#: Warnings every run would print that say nothing about this run.
QUIET_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # Lightning on torch >= 2.10
    r".*does not have many workers.*",  # in-memory client data needs no loader workers
    r".*The number of training batches .* is smaller than the logging interval.*",
    r"Starting from v1\.9\.0, `tensorboardX` has been removed.*",  # the CSVLogger default
    # the run chose its precision: --float32_matmul_precision, or the user's own call
    r".*TensorFloat32 tensor cores for float32 matrix multiplication available but not.*",
)
#: Lightning's loggers of tips, accelerator lines and the seed line (INFO).
QUIET_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
)
#: Set to 1 to keep Lightning's console as it is.
VERBOSE_ENVIRONMENT = "LIGHTNING_FL_VERBOSE"


def quiet_console() -> None:
    """The console of every lightning_fl run, command line or script: Lightning's tips,
    accelerator lines and seed line off, the warnings of :data:`QUIET_WARNINGS` and
    LightningCLI's own jsonargparse deprecations filtered; Lightning's warnings about the
    run and the library's own stay. Applied when ``lightning_fl`` is imported, unless
    ``LIGHTNING_FL_VERBOSE=1``."""
    if os.environ.get(VERBOSE_ENVIRONMENT, "") not in ("", "0"):
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    # LightningCLI's own calls of jsonargparse APIs that 4.49 deprecates: not the user's
    warnings.filterwarnings(
        "ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli"
    )
