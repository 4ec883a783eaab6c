"""Personalization baselines of the FedEM and kNN-Per papers (Marfoq thesis §3.5.6,
§3.6.3, Tables 3.2 and 3.5): FedAvg+ (local fine-tuning), Ditto, APFL, FedRep and pFedMe.

Each keeps its per-client state in the client store: a model-sized personal copy costs
4·d bytes per client that has one (FedRep: only the head). Unseen clients are adapted
at evaluation as the kNN-Per paper describes (§3.6.3): FedAvg+ and Ditto by local SGD
(Ditto with its proximal term), APFL by training its local model, FedRep by training a
head on the frozen body, pFedMe by its local procedure from the global model.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_fl.checks import require_rate
from lightning_fl.engine.local_training import (
    batches,
    client_loader,
    grads_at,
    log_global_baseline,
    sgd,
    training_mode,
)
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.tensors import TensorList, flatten, unflatten
from lightning_fl.engine.traits import Trait

#: The round key of the data-order seeds of an unseen client's adaptation.
UNSEEN_ROUND = -1


def _params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


def _store_params(state_store, client: int, key: str, tensors: TensorList) -> None:
    state_store.set(client, key, flatten([t.detach() for t in tensors]).clone())


def _load_params(state_store, client: int, key: str, like: TensorList) -> TensorList | None:
    flat = state_store.get(client, key)
    return None if flat is None else [t.clone() for t in unflatten(flat.to(like[0].device), like)]


def _is_unseen(trainer: pl.Trainer, client: int) -> bool:
    return client in set(trainer.datamodule.unseen_clients)


class FineTune(FederatedCallback):
    """FedAvg+ (Jiang et al. 2019; FedEM §3.5.6): before a client is evaluated, the global
    model is fine-tuned by ``epochs`` passes of local SGD (learning rate ``lr``) on the
    client's training data; the global model itself is never changed. Seen and unseen
    clients are treated alike. ``stages`` says when: the paper fine-tunes once, after
    training (``("test",)``)."""

    traits = {Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (FineTune or the other)"}

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    requires_task_loss = True

    def __init__(
        self, lr: float = 0.01, epochs: int = 1, stages: tuple[str, ...] = ("test",)
    ) -> None:
        require_rate("lr", lr, 0.01)
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}.")
        self.lr, self.epochs, self.stages = lr, epochs, tuple(stages)

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        stage = "test" if trainer.testing else "validate"
        if stage not in self.stages or trainer.sanity_checking:
            return
        loader = client_loader(
            trainer, client, "train", (self.view.config.seed, "finetune", client)
        )
        if loader is not None:
            sgd(pl_module, _params(pl_module), loader, self.lr, self.epochs)


class Ditto(FederatedCallback):
    """Ditto (Li et al., ICML 2021, Alg. 1). The global model trains as in FedAvg (the
    user's local steps); each participating client also updates its personal model v_k by
    ``personal_epochs`` passes of v ← v − η_p(∇F_k(v) + λ(v − w^t)), w^t being the model the
    client received and starts its local steps from (the round's global model; under
    :class:`AsynchronousFL` the stale model it was sent), read after the aggregator's
    ``on_client_start``. v_k starts from the first global model (w^0). Clients are
    evaluated with v_k; an unseen client trains v from the final global model the same way.
    With ``log_global`` each client is also evaluated with the global model w first,
    logged as ``val_global_acc`` (``test_global_acc``, ``*_global_loss``, with their
    weighted, uniform and 10th-percentile values): Ditto's baseline beside its
    personalized models (Li et al. report both), for one more pass over the evaluation
    data.

    Args:
        lam: λ, the proximal weight (the kNN-Per paper tunes it per client over
            {10, 1, 0.1, 0.01}).
        personal_lr: η_p. personal_epochs: passes per participation.
        log_global: also evaluate the global model on each client.
    """

    traits = {Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (Ditto or the other)"}

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    requires_task_loss = True

    key = "ditto_personal"

    def __init__(
        self,
        lam: float = 0.1,
        personal_lr: float = 0.01,
        personal_epochs: int = 1,
        log_global: bool = True,
    ) -> None:
        require_rate("lam", lam, 0.1, allow_zero=True)
        require_rate("personal_lr", personal_lr, 0.01)
        self.lam, self.personal_lr, self.personal_epochs = lam, personal_lr, personal_epochs
        self.log_global = log_global
        self.add_client_state("personal", key=self.key)  # v_k
        self.add_server_state("initial")  # w^0, every v_k's start
        #: w^t of each client started and not yet ended (vectorized clients start together)
        self._received: dict[int, TensorList] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        """w^0: the model the fit starts from (a resumed fit's, restored, is kept)."""
        if self.initial is None:
            self.initial = flatten(_params(pl_module)).detach().clone()

    def on_server_start(self, rounds: int | None) -> None:
        """Flower's server-side mode: w^0 is the server's first model, sent to the nodes
        with the rest of the declared server state."""
        if self.initial is None:
            self.initial = flatten(self.view.tensors.params).detach().clone()

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._received[client] = [p.detach().clone() for p in _params(pl_module)]

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        self._received.clear()  # the clients whose update was dropped

    def _train_personal(
        self, trainer, module, client: int, start: TensorList, anchor: TensorList, tag: Any
    ) -> None:
        params = _params(module)
        loader = client_loader(
            trainer, client, "train", (self.view.config.seed, "ditto", tag, client)
        )
        if loader is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(params, start)

        def proximal() -> TensorList:
            return torch._foreach_mul(
                torch._foreach_sub([p.detach() for p in params], anchor), self.lam
            )

        sgd(module, params, loader, self.personal_lr, self.personal_epochs, extra_grad=proximal)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        anchor = self._received.pop(client)
        start = _load_params(state.store, client, self.key, anchor)
        if start is None:
            start = unflatten(self.initial.to(anchor[0].device), anchor)
        self._train_personal(trainer, pl_module, client, start, anchor, state.round_idx)
        _store_params(state.store, client, self.key, _params(pl_module))

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        params = _params(pl_module)
        if self.log_global:
            log_global_baseline(trainer, pl_module, client)
        if _is_unseen(trainer, client):
            anchor = [p.detach().clone() for p in params]
            self._train_personal(trainer, pl_module, client, anchor, anchor, UNSEEN_ROUND)
            return
        personal = _load_params(self.view.store, client, self.key, params)
        if personal is not None:
            with torch.no_grad():
                torch._foreach_copy_(params, personal)


class _BatchHook(FederatedCallback):
    """Keeps the current training batch for algorithms that take an extra step on it in
    ``on_before_optimizer_step`` (after the client switch, before w changes)."""

    def __init__(self) -> None:
        self._batch: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch = batch

    def _training_client(self, trainer) -> int | None:
        if self._batch is None or len(self._batch) == 0:
            return None  # idle (padding) batch
        return trainer.strategy.training_client


class APFL(_BatchHook):
    """APFL (Deng et al. 2020, Alg. 1). Each client keeps a local model v and a mixing
    weight α; its personalized model is v̄ = αv + (1−α)w. At every local step, on the same
    batch ξ and with w before its own step:
    w ← w − η∇f(w; ξ) (the user's step), v ← v − η_v α∇f(v̄; ξ), and, with
    ``adaptive_alpha``, α ← α − η_α ⟨v − w, ∇f(v̄; ξ)⟩ clipped to [0, 1].
    v starts from the first global model the client receives. Clients are evaluated with
    α v + (1−α) w^T; an unseen client trains v for ``adapt_epochs`` with w frozen.

    Vectorized clients: the chunk's local models and mixing weights are stacked by row,
    and every vectorized step takes each row's v (and α) step at its own v̄ on its own
    batch, with the dropout masks the sequential path would draw next.
    """

    traits = {Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (APFL or the other)"}

    supports_vectorized_clients = True

    requires_task_loss = True

    v_key, alpha_key = "apfl_v", "apfl_alpha"

    def __init__(
        self,
        alpha: float = 0.5,
        local_lr: float = 0.01,
        adaptive_alpha: bool = False,
        alpha_lr: float = 0.01,
        adapt_epochs: int = 1,
    ) -> None:
        super().__init__()
        self.add_client_state("v", key=self.v_key)  # the local model
        self.add_client_state("alpha", key=self.alpha_key)  # its mixing weight (adaptive)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}.")
        require_rate("local_lr", local_lr, 0.01)
        require_rate("alpha_lr", alpha_lr, 0.01)
        self.alpha, self.local_lr = alpha, local_lr
        self.adaptive_alpha, self.alpha_lr, self.adapt_epochs = (
            adaptive_alpha,
            alpha_lr,
            adapt_epochs,
        )
        self._v: TensorList | None = None
        self._a = alpha
        #: vectorized clients: the chunk's v and α, stacked by row
        self._rows_v: TensorList = []
        self._rows_alpha: Tensor | None = None

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        if self.view.config.vectorize:  # the chunk's v and α are stacked at its start
            return
        params = _params(pl_module)
        v = _load_params(state.store, client, self.v_key, params)
        self._v = [p.detach().clone() for p in params] if v is None else v
        self._a = float(state.store.get(client, self.alpha_key, self.alpha))

    def _step(self, module, batch, w: TensorList) -> None:
        """One step of v (and α) at v̄ = αv + (1−α)w, all at their values before the step."""
        alpha = self._a
        mixed = [alpha * v + (1 - alpha) * wi for v, wi in zip(self._v, w)]
        grads = grads_at(module, _params(module), mixed, batch)
        if self.adaptive_alpha:
            diff = torch._foreach_sub(self._v, w)
            slope = sum(float((d * g).sum()) for d, g in zip(diff, grads))
            self._a = min(1.0, max(0.0, alpha - self.alpha_lr * slope))
        torch._foreach_add_(self._v, grads, alpha=-self.local_lr * alpha)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._training_client(trainer) is None:
            return
        w = [p.detach().clone() for p in _params(pl_module)]
        self._step(pl_module, self._batch, w)

    def on_vectorized_clients_start(self, trainer, pl_module, clients, state: RoundState) -> None:
        """Stack the chunk's v (a client without one: its starting model) and α by row."""
        starts = state.chunk.params
        rows_v = []
        for row, client in enumerate(clients):
            start = [t[row] for t in starts]
            v = _load_params(state.store, client, self.v_key, start)
            rows_v.append([t.clone() for t in start] if v is None else v)
        self._rows_v = [torch.stack(column) for column in zip(*rows_v)]
        alphas = [float(state.store.get(c, self.alpha_key, self.alpha)) for c in clients]
        self._rows_alpha = torch.tensor(alphas, dtype=torch.float64, device=starts[0].device)

    @torch.no_grad()
    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        """:meth:`_step` for every row at once: the gradient at each row's own v̄ (the
        stacked ``params`` are each row's w before its step)."""
        index = torch.tensor(rows, device=params[0].device)
        v = [t[index] for t in self._rows_v]
        alpha = self._rows_alpha[index]

        def per_row(values: Tensor, like: Tensor) -> Tensor:  # as Python floats scale
            return values.to(like.device, like.dtype).reshape(-1, *[1] * (like.dim() - 1))

        mixed = [per_row(alpha, vi) * vi + per_row(1 - alpha, vi) * wi for vi, wi in zip(v, params)]
        g = state.vectorized_step.gradients_at(state.chunk, rows, mixed)
        if self.adaptive_alpha:
            slope = sum(
                ((vi - wi) * gi).reshape(len(rows), -1).sum(1).double()
                for vi, wi, gi in zip(v, params, g)
            )
            self._rows_alpha[index] = (alpha - self.alpha_lr * slope).clamp(0.0, 1.0)
        for full, vi, gi in zip(self._rows_v, v, g):
            full[index] = vi + per_row(-self.local_lr * alpha, gi) * gi

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        if state.chunk is not None:  # this client's row of the stacked chunk
            row = state.chunk.clients.index(client)
            self._v = [t[row] for t in self._rows_v]
            self._a = float(self._rows_alpha[row])
        _store_params(state.store, client, self.v_key, self._v)
        state.store.set(client, self.alpha_key, self._a)

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        params = _params(pl_module)
        store = self.view.store
        with training_mode(pl_module):  # normal (not inference) tensors, autograd on
            w = [p.detach().clone() for p in params]
            if _is_unseen(trainer, client):
                self._v, self._a = [t.clone() for t in w], self.alpha
                loader = client_loader(
                    trainer, client, "train", (self.view.config.seed, "apfl", UNSEEN_ROUND, client)
                )
                for _ in range(self.adapt_epochs if loader is not None else 0):
                    for batch in batches(loader, pl_module.device):
                        self._step(pl_module, batch, w)
                v, alpha = self._v, self._a
            else:
                v = _load_params(store, client, self.v_key, params)
                alpha = float(store.get(client, self.alpha_key, self.alpha))
        if v is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(params, [alpha * vi + (1 - alpha) * wi for vi, wi in zip(v, w)])


class FedRep(FederatedCallback):
    """FedRep (Collins et al., ICML 2021, Alg. 1): a shared body and a personal head. Each
    participating client first trains its own head for ``head_epochs`` passes (body
    frozen, learning rate ``head_lr``), then the body with the head frozen (the strategy's
    local epochs/steps of the user's optimizer). Only the body is aggregated: the head's
    entries of every update are zero, so the global head never moves. Heads live in the
    client store; a client without one starts from the global head. An unseen client
    trains a head on the frozen body before its evaluation.

    Vectorized clients: each client's head is loaded and trained when it starts, as on
    the sequential path; the chunk then trains the bodies together, the frozen head left
    out of the stacked optimizer's step (its ``frozen`` positions).

    Args:
        head: names of the head's modules (default: the last ``nn.Linear``).
    """

    traits = {
        Trait.FREEZES_PART_OF_THE_MODEL: "",
        Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (FedRep or the other)",
    }

    requires_task_loss = True
    supports_vectorized_clients = True

    key = "fedrep_head"

    def __init__(
        self, head: list[str] | None = None, head_epochs: int = 10, head_lr: float = 0.01
    ) -> None:
        require_rate("head_lr", head_lr, 0.01)
        self.head, self.head_epochs, self.head_lr = head, head_epochs, head_lr
        self.add_client_state("head", key=self.key)  # the client's head

    def head_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        from lightning_fl.callbacks.knn_per import last_linear

        names = self.head or [last_linear(module)]
        modules = dict(module.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"{type(module).__name__} has no module named {missing}: check head=.")
        return [p for n in names for p in modules[n].parameters()]

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(self.head_parameters(pl_module)) == len(_params(pl_module)):
            raise ValueError(
                "FedRep needs a shared body, but the head holds every parameter of "
                f"{type(pl_module).__name__} (a linear model?): use a network with a hidden "
                "layer, or name a smaller head with head=[...]."
            )

    def _head_mask(self, module: nn.Module) -> list[bool]:
        head = {id(p) for p in self.head_parameters(module)}
        return [id(p) in head for p in module.parameters()]

    def _train_head(self, trainer, module, client: int, tag: Any) -> None:
        head = self.head_parameters(module)
        loader = client_loader(
            trainer, client, "train", (self.view.config.seed, "fedrep", tag, client)
        )
        if loader is not None and self.head_epochs > 0:
            sgd(module, head, loader, self.head_lr, self.head_epochs)

    def _load_head(self, store, client: int, module: nn.Module) -> None:
        head = self.head_parameters(module)
        saved = _load_params(store, client, self.key, head)
        if saved is not None:
            with torch.no_grad():
                torch._foreach_copy_(head, saved)

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._release(pl_module)  # vectorized clients start one after another, then train
        self._load_head(state.store, client, pl_module)
        self._train_head(trainer, pl_module, client, state.round_idx)
        for p in self.head_parameters(pl_module):
            p.requires_grad_(False)

    def transform_update(
        self, trainer, pl_module, client: int, update: TensorList, state: RoundState
    ) -> TensorList:
        mask = self._head_mask(pl_module)
        return [
            torch.zeros_like(u) if i < len(mask) and mask[i] else u for i, u in enumerate(update)
        ]

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self._release(pl_module)
        _store_params(state.store, client, self.key, self.head_parameters(pl_module))

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        self._release(pl_module)

    def _release(self, module: nn.Module) -> None:
        for p in self.head_parameters(module):
            p.requires_grad_(True)

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        if _is_unseen(trainer, client):
            self._train_head(trainer, pl_module, client, UNSEEN_ROUND)
        else:
            self._load_head(self.view.store, client, pl_module)


class PFedMe(_BatchHook):
    """pFedMe (Dinh et al., NeurIPS 2020, Alg. 1). At every local step on batch ξ, the
    personalized model θ̂ ≈ argmin_θ f(θ; ξ) + (λ/2)‖θ − w‖² is found by ``inner_steps``
    (K) gradient steps θ ← θ − η_p(∇f(θ; ξ) + λ(θ − w)) from θ = w; then the local model
    moves w ← w − ηλ(w − θ̂): the strategy's optimizer takes that step because its
    gradient is replaced by λ(w − θ̂), so it must be plain SGD (no momentum, no weight
    decay) at learning rate η. The server step w ← (1−β)w + β·avg(w_i) is FedAvg with
    ``server_lr=β``. Clients are evaluated with their last θ̂; an unseen client runs one
    pass of this local procedure from the global model.

    Vectorized clients: the K inner steps run for every row at once
    (``VectorizedStep.gradients_at``, new dropout masks at each, as the sequential path
    draws them), and each row's gradient is replaced by λ(w − θ̂).
    """

    traits = {
        Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (PFedMe or the other)",
        Trait.STEPS_FROM_NON_PRIVATE_GRADIENTS: "",
    }

    supports_vectorized_clients = True

    requires_task_loss = True

    key = "pfedme_personal"

    def __init__(self, lam: float = 15.0, personal_lr: float = 0.01, inner_steps: int = 5) -> None:
        super().__init__()
        self.add_client_state("personal", key=self.key)  # θ̂, the client's personal model
        require_rate("personal_lr", personal_lr, 0.01)
        require_rate("lam", lam, 15.0)
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}.")
        self.lam, self.personal_lr, self.inner_steps = lam, personal_lr, inner_steps
        self._theta: TensorList | None = None
        #: vectorized clients: the chunk's last θ̂ by row, and the rows that took a step
        self._rows_theta: TensorList = []
        self._rows_stepped: set[int] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        for optimizer in trainer.optimizers:
            plain = isinstance(optimizer, torch.optim.SGD) and all(
                g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0
                for g in optimizer.param_groups
            )
            if not plain:
                raise ValueError(
                    "PFedMe's local step w ← w − ηλ(w − θ̂) needs plain SGD: set optimizer 'sgd' "
                    "with momentum 0 and weight_decay 0."
                )

    def personalize(self, module, batch, w: TensorList, gradient=None) -> TensorList:
        """θ̂(w; ξ) by K proximal gradient steps from w; ``gradient(θ)``: ∇f(θ; ξ)
        (default: the module's loss on ``batch``)."""
        theta = [t.clone() for t in w]
        params = _params(module)
        for _ in range(self.inner_steps):
            grads = grads_at(module, params, theta, batch) if gradient is None else gradient(theta)
            prox = torch._foreach_mul(torch._foreach_sub(theta, w), self.lam)
            torch._foreach_add_(grads, prox)
            torch._foreach_add_(theta, grads, alpha=-self.personal_lr)
        return theta

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._training_client(trainer) is None:
            return
        params = _params(pl_module)
        w = [p.detach().clone() for p in params]
        self._theta = self.personalize(pl_module, self._batch, w)
        for p, wi, ti in zip(params, w, self._theta):
            p.grad = self.lam * (wi - ti)

    def on_vectorized_clients_start(self, trainer, pl_module, clients, state: RoundState) -> None:
        self._rows_theta = [torch.zeros_like(t) for t in state.chunk.params]
        self._rows_stepped = set()

    @torch.no_grad()
    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        """:meth:`on_before_optimizer_step` for every row at once (``params``: each row's w)."""
        theta = self.personalize(
            pl_module, None, list(params),
            lambda values: state.vectorized_step.gradients_at(state.chunk, rows, values),
        )  # fmt: skip
        index = torch.tensor(rows, device=params[0].device)
        for g, full, wi, ti in zip(grads, self._rows_theta, params, theta):
            if g is not None:
                g.copy_(self.lam * (wi - ti))
            full[index] = ti
        self._rows_stepped.update(rows)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        if state.chunk is not None:  # this client's row, if it took a step
            row = state.chunk.clients.index(client)
            stepped = row in self._rows_stepped
            self._theta = [t[row] for t in self._rows_theta] if stepped else None
        if self._theta is not None:
            _store_params(state.store, client, self.key, self._theta)
        self._theta = None

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        params = _params(pl_module)
        if _is_unseen(trainer, client):
            loader = client_loader(
                trainer, client, "train", (self.view.config.seed, "pfedme", UNSEEN_ROUND, client)
            )
            if loader is None:
                return
            lr = (
                trainer.optimizers[0].param_groups[0]["lr"]
                if trainer.optimizers
                else self.personal_lr
            )
            w = [p.detach().clone() for p in params]
            theta = w
            with training_mode(pl_module):
                for batch in batches(loader, pl_module.device):
                    theta = self.personalize(pl_module, batch, w)
                    w = [wi - lr * self.lam * (wi - ti) for wi, ti in zip(w, theta)]
        else:
            theta = _load_params(self.view.store, client, self.key, params)
            if theta is None:
                return
        with torch.no_grad():
            torch._foreach_copy_(params, theta)
