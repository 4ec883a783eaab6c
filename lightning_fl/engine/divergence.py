"""A warning when training diverges without ever producing NaN (the NaN case drops the
update and is counted in ``fl/dropped_updates``)."""

from __future__ import annotations

import warnings

import torch

#: A round whose mean training loss exceeds this many times the fit's first step loss
#: is diverging.
DIVERGENCE_FACTOR = 100.0


class DivergenceWarning(UserWarning):
    """The training loss exploded: the learning rate is probably too high."""


class DivergenceMonitor:
    """Sums the training losses of a round on the device (no sync per step) and, at the
    round's end, warns once per fit when their mean exceeds ``factor`` × the loss of the
    fit's first step."""

    def __init__(self, factor: float = DIVERGENCE_FACTOR) -> None:
        self.factor = factor
        self.reset()

    def reset(self) -> None:
        self.first: float | None = None
        self.warned = False
        self._sum: torch.Tensor | None = None
        self._count = 0

    def observe(self, loss: torch.Tensor) -> None:
        """One step's loss, or a vector of the losses of several clients' steps."""
        loss = loss.detach()
        if self.first is None:
            self.first = float(loss.reshape(-1)[0])  # one sync per fit
        total = loss if loss.dim() == 0 else loss.sum()
        self._sum = total.float() if self._sum is None else self._sum + total
        self._count += loss.numel()

    def end_round(self, round_idx: int) -> None:
        if self._sum is None:
            return
        mean = float(self._sum) / self._count
        self._sum, self._count = None, 0
        if self.warned or self.first is None or not self.first > 0 or mean != mean:
            return
        if mean > self.factor * self.first:
            self.warned = True
            warnings.warn(
                f"Round {round_idx}: the mean training loss is {mean:.3g}, "
                f"{mean / self.first:.3g}× the first step's {self.first:.3g}: training is "
                "diverging. Lower the learning rate or clip gradients "
                "(Trainer(gradient_clip_val=...)).",
                DivergenceWarning,
                stacklevel=2,
            )
