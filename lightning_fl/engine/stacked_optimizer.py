"""The module's optimizer and gradient clipping over stacked client parameters.

Vectorized clients (:mod:`lightning_fl.engine.vectorized`) stack the clients' parameters
along a leading row dimension. :class:`StackedOptimizer` steps them with ``torch.optim``'s
own functional implementations (``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``,
``torch.optim.adamw.adamw``, single-tensor path), each client with its own state: the
update rules, and every option torch implements for them (momentum, dampening, Nesterov,
weight decay, ``maximize``, ``amsgrad``, decoupled weight decay), are torch's, not a copy.
The rules act element by element, so one call on a stacked tensor is every row's own step.
Rows that differ in a setting the functional takes as one number (a step count, whether a
momentum buffer exists yet, a per-client learning-rate factor) are stepped in groups of
equal settings; a chunk's clients usually form one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from lightning_fl.engine.tensors import TensorList
from lightning_fl.engine.vectorized_checks import refuse

#: The optimizers a vectorized step can apply, and their functional forms.
SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class StackedOptimizer:
    """The module's torch optimizer, applied to stacked client parameters with per-client
    state. Learning rates and other settings are read from the optimizer's param groups
    at every step, so LR schedulers keep working. The state of one client converts to
    and from the optimizer's own ``state_dict()["state"]`` format, which
    ``keep_optimizer_state`` stores.

    ``lr_scale`` (one factor per row of the chunk, host-side floats, or None) multiplies
    each client's learning rate, as a sequential callback that scales the param groups'
    ``lr`` around its client's optimizer steps does (GossipAveraging's (n_t/n)·T·η); it is
    reset to None when a chunk starts, so callbacks set it in
    ``on_vectorized_clients_start``."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> None:
        if type(optimizer) not in SUPPORTED:
            raise refuse(
                f"the optimizer is {type(optimizer).__name__}; vectorized clients support "
                "torch.optim.SGD, Adam and AdamW."
            )
        self.kind = "sgd" if type(optimizer) is torch.optim.SGD else "adam"
        self.optimizer = optimizer
        index_of = {}
        i = 0
        for group in optimizer.param_groups:
            if group.get("differentiable"):
                raise refuse("differentiable optimizers are not supported.")
            for p in group["params"]:
                index_of[id(p)] = (group, i)
                i += 1
        #: (position among the module's parameters, its param group, its state index)
        self.slots = [
            (j, *index_of[id(p)])
            for j, p in enumerate(params)
            if id(p) in index_of and p.requires_grad
        ]
        #: per slot: the stacked state tensors (rows = clients)
        self.state: list[dict[str, Tensor]] = []
        #: per slot: each row's step count (Adam) or whether its momentum buffer exists
        #: (SGD); host-side bookkeeping, as torch.optim keeps its step counts on the CPU
        self.counts: list[np.ndarray] = []
        self.lr_scale: list[float] | None = None
        #: positions of trainable parameters frozen for the current chunk (the module's
        #: ``requires_grad`` after the clients started: FedRep's head), never stepped
        self.frozen: set[int] = set()

    @property
    def trainable(self) -> list[int]:
        """Positions of the parameters this optimizer updates."""
        return [j for j, _, _ in self.slots]

    @property
    def stepped(self) -> list[int]:
        """Positions of the parameters the current chunk's steps update: the trainable ones
        less the frozen ones."""
        return [j for j, _, _ in self.slots if j not in self.frozen]

    def _state_names(self, group: dict) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def reset(self, params: TensorList, saved: Sequence[dict | None]) -> None:
        """Fresh state for the stacked ``params`` (rows = clients), or each client's saved
        ``state_dict()["state"]``."""
        rows = len(saved)
        self.state, self.counts, self.lr_scale = [], [], None
        for j, group, index in self.slots:
            entry = {name: torch.zeros_like(params[j]) for name in self._state_names(group)}
            counts = np.zeros(rows, dtype=np.int64)
            for row, state in enumerate(saved):
                own = (state or {}).get(index)
                if not own:
                    continue
                if self.kind == "sgd":
                    if own.get("momentum_buffer") is not None:
                        entry["momentum_buffer"][row] = own["momentum_buffer"]
                        counts[row] = 1
                    continue
                counts[row] = int(own["step"])
                for name in entry:
                    entry[name][row] = own[name]
            self.state.append(entry)
            self.counts.append(counts)

    def state_of(self, row: int) -> dict[int, dict[str, Any]]:
        """Client ``row``'s state in the optimizer's ``state_dict()["state"]`` format."""
        out: dict[int, dict[str, Any]] = {}
        for (_, group, index), entry, counts in zip(self.slots, self.state, self.counts):
            if self.kind == "sgd":
                if group["momentum"] != 0 and counts[row]:
                    out[index] = {"momentum_buffer": entry["momentum_buffer"][row].clone()}
            elif counts[row] > 0:
                out[index] = {  # host: torch.optim keeps a step count on the CPU
                    "step": torch.tensor(float(counts[row])),
                    **{name: value[row].clone() for name, value in entry.items()},
                }
        return out

    @torch.no_grad()
    def step(
        self,
        params: TensorList,
        grads: list[Tensor | None],
        rows: list[int],
        index: Tensor | None,
    ) -> None:
        """One step of the chunk's rows ``rows`` (``index``: the same rows on the device, or
        None when they are every row); ``grads[k]`` is the stacked gradient of the k-th
        :attr:`stepped` parameter, ``rows`` only, or None for a parameter the loss does
        not use. A frozen parameter and one without gradient are left alone, their state
        included, as torch skips a parameter whose ``grad`` is None."""
        slots = zip(self.slots, self.state, self.counts)
        active = [(slot, entry, counts) for slot, entry, counts in slots
                  if slot[0] not in self.frozen]  # fmt: skip
        at_rows = np.asarray(rows)
        # every row of every step at once: one functional call per setting (the usual case)
        whole: dict[tuple[int, int, float], tuple[dict, list]] = {}
        for ((j, group, _), entry, counts), grad in zip(active, grads, strict=True):
            if grad is None:
                continue
            groups = self._row_groups(rows, counts[at_rows])
            for (count, factor), members in groups.items():
                if members is None and index is None:
                    key = (id(group), count, factor)
                    whole.setdefault(key, (group, []))[1].append((params[j], grad, entry))
                elif members is None:  # every row of the step: no regrouping
                    self._apply(params[j], grad, entry, group, count, factor, index)
                else:
                    at = torch.tensor([rows[k] for k in members], device=grad.device)
                    within = torch.tensor(members, device=grad.device)
                    self._apply(params[j], grad[within], entry, group, count, factor, at)
            if self.kind == "adam":
                counts[at_rows] += 1
            else:
                counts[at_rows] = 1
        for (_, count, factor), (group, tensors) in whole.items():
            self._apply_every_row(tensors, group, count, factor)

    def _apply_every_row(
        self, tensors: list[tuple[Tensor, Tensor, dict[str, Tensor]]], group: dict,
        count: int, factor: float,
    ) -> None:  # fmt: skip
        """Step every row of several parameters (``(stacked param, grad, state)``) of one
        param group and one count in one functional call, in place: torch's single-tensor
        rule loops over them as it would over separate calls."""
        lr = _lr(group, factor)
        params = [p for p, _, _ in tensors]
        grads = [g for _, g, _ in tensors]
        states = [entry for _, _, entry in tensors]
        if self.kind == "sgd":
            _sgd_step(params, grads, states, group, lr, fresh=count == 0)
        else:
            _adam_step(params, grads, states, group, lr, count, type(self.optimizer))

    def _row_groups(
        self, rows: list[int], counts: np.ndarray
    ) -> dict[tuple[int, float], list[int] | None]:
        """Positions in ``rows`` grouped by what the functional takes as one number: the
        row's count (Adam's step; SGD's "has a momentum buffer", ``counts``: the rows') and
        its lr factor. One group of every row (the usual case: positions None) is found
        without a Python loop over the rows."""
        if not len(counts):
            return {}
        if self.lr_scale is None and counts.min() == counts.max():
            return {(int(counts[0]), 1.0): None}
        groups: dict[tuple[int, float], list[int] | None] = {}
        for k, row in enumerate(rows):
            factor = 1.0 if self.lr_scale is None else self.lr_scale[row]
            groups.setdefault((int(counts[k]), factor), []).append(k)
        if len(groups) == 1:
            return dict.fromkeys(groups)  # every row: no regrouping
        return groups

    def _apply(
        self,
        full: Tensor,
        grad: Tensor,
        entry: dict[str, Tensor],
        group: dict,
        count: int,
        factor: float,
        at: Tensor,
    ) -> None:
        """Step the rows ``at`` of ``full`` with torch's functional rule, their state
        gathered from ``entry`` and written back. Plain SGD (no momentum, no weight decay:
        no state) adds ``-lr·grad`` to the rows in place, the same ``add_`` as torch's
        single-tensor rule, without gathering them."""
        if self.kind == "sgd" and _stateless(group):
            lr = _lr(group, factor)
            full.index_add_(0, at, grad, alpha=lr if group["maximize"] else -lr)
            return
        p = full[at]
        state = {name: value[at] for name, value in entry.items()}
        self._apply_every_row([(p, grad, state)], group, count, factor)
        full[at] = p
        for name, value in state.items():
            entry[name][at] = value


def _lr(group: dict, factor: float) -> float:
    """The param group's learning rate times a row's factor (``lr_scale``)."""
    return group["lr"] if factor == 1.0 else group["lr"] * factor


def _stateless(group: dict) -> bool:
    """Whether torch's SGD steps this param group as ``param.add_(grad, alpha=-lr)``."""
    return group["momentum"] == 0 and group["weight_decay"] == 0


def _sgd_step(
    params: TensorList, grads: TensorList, states: list[dict], group: dict, lr: float, fresh: bool
) -> None:
    """``torch.optim.sgd.sgd`` on stacked rows ``params`` (their ``states``' momentum
    buffers); ``fresh``: no momentum buffer yet (torch starts it as a copy of the first
    gradient)."""
    buffers = [None if fresh else state["momentum_buffer"] for state in states]
    sgd(params, grads, buffers, foreach=False, weight_decay=group["weight_decay"],
        momentum=group["momentum"], lr=lr, dampening=group["dampening"],
        nesterov=group["nesterov"], maximize=group["maximize"])  # fmt: skip
    if fresh:
        for state, buffer in zip(states, buffers):
            if buffer is not None:
                state["momentum_buffer"].copy_(buffer)


def _adam_step(
    params: TensorList, grads: TensorList, states: list[dict], group: dict, lr: float,
    count: int, kind: type,
) -> None:  # fmt: skip
    """``torch.optim.adam.adam`` (``adamw.adamw`` for decoupled weight decay) on stacked
    rows ``params``, whose step count is ``count`` before this step."""
    steps = [torch.tensor(float(count)) for _ in params]  # host: torch.optim's step counts
    decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    function = adamw if decoupled else adam
    max_sq = [state["max_exp_avg_sq"] for state in states] if group["amsgrad"] else []
    beta1, beta2 = group["betas"]
    function(params, grads, [state["exp_avg"] for state in states],
             [state["exp_avg_sq"] for state in states], max_sq, steps,
             foreach=False, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=group["maximize"])  # fmt: skip


def clip_gradients_(grads: TensorList, value: float, algorithm: str) -> None:
    """Lightning's gradient clipping, per client: by each row's total 2-norm
    (``clip_grad_norm_``: coefficient value/(norm + 1e-6), at most 1) or by value."""
    if algorithm == "value":
        torch._foreach_clamp_min_(grads, -value)
        torch._foreach_clamp_max_(grads, value)
        return
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads], dim=1).norm(dim=1)
    coef = (value / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
