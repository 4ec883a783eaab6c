"""FedEM: federated EM over a mixture of M shared components (Marfoq et al., NeurIPS 2021;
Marfoq thesis §3.5, Algorithm 7 and, with :class:`~lightning_fl.callbacks.GossipAveraging`,
Algorithm 8)."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_fl.engine.local_training import batches, client_loader, evaluation_mode
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.mixture import MixtureClassifier

#: π_t's client store key (kept from the first release: its checkpoints resume)
STORE_KEY = "fedem_pi"


def e_step(module: MixtureClassifier, loader, log_prior: Tensor) -> Tensor:
    """Responsibilities of Alg. 7's E-step for every sample of ``loader``:
    q(z_i = m) = π_m exp(−ℓ(h_θm(x_i), y_i)) / Σ_m' π_m' exp(−ℓ(h_θm'(x_i), y_i)),
    computed as softmax(log π − ℓ) with the module's current components (eval mode)."""
    with evaluation_mode(module):
        losses = torch.cat(
            [module.component_losses(x, y) for x, y in batches(loader, module.device)]
        )
    return torch.softmax(log_prior.to(losses) - losses, dim=1)


def update_mixture_weights(q: Tensor) -> Tensor:
    """Alg. 7's M-step for π_t: π_tm = (1/n_t) Σ_i q(z_i = m)."""
    return q.mean(dim=0)


class FedEM(FederatedCallback):
    """Runs FedEM's client steps around the user's local training of a
    :class:`~lightning_fl.systems.mixture.MixtureClassifier`.

    For each participating client t in round k (Alg. 7):

    1. E-step over the client's whole training set with the received components θ^{k−1}
       and its mixture weights π_t^{k−1}: q_t^k (:func:`e_step`);
    2. π_t^k = mean of q_t^k (:func:`update_mixture_weights`), kept in the client store
       (and so in checkpoints); it is never sent to the server;
    3. local training: the strategy's local epochs/steps of the module's optimizer on the
       q-weighted losses; q of a sample is recomputed per batch from a frozen copy of
       θ^{k−1} and π_t^{k−1}, which gives exactly q_t^k without storing it;
    4. aggregation: the aggregator averages every component's parameters, with weights
       n_t/n under FedAvg's default sample weighting.

    Evaluation uses each client's π_t in the personalized predictor (3.5). A client that
    has not trained yet uses the uniform π (the authors' initialization). An unseen client
    keeps the components frozen, starts from the uniform π and runs one E-step and one π
    update on its training data (§3.5.6, Table 3.3).
    """

    traits = {Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (FedEM or the other)"}

    module_type = "MixtureClassifier"
    supports_vectorized_clients = True

    def __init__(self) -> None:
        self.add_client_state("pi", key=STORE_KEY)  # π_t, the client's mixture weights
        self.add_round_sum("entropy", shape=(2,))  # Σ H(π_t) and the clients counted
        self._reference: torch.nn.ModuleList | None = None
        #: per component of the frozen copy: its tensors' positions in :func:`_tensors`
        #: and their names inside the component, for the vmapped loss
        self._component_slots: list[list[tuple[int, str]]] = []
        #: (log π_t^{k−1}, log π_t^k, θ_t^{k−1}) of this round's started clients, for
        #: vectorized clients (θ^{k−1} differs between clients under GossipAveraging)
        self._started: dict[int, tuple[Tensor, Tensor, list[Tensor]]] = {}
        #: the last round's mean entropy of π (None: no client counted)
        self._entropy: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(pl_module, MixtureClassifier):
            raise TypeError(
                f"FedEM needs a lightning_fl.MixtureClassifier, got {type(pl_module).__name__}: "
                "wrap your network as MixtureClassifier(network, num_components=M)."
            )

    @staticmethod
    def uniform(module: MixtureClassifier) -> Tensor:
        m = module.num_components
        return torch.full((m,), 1.0 / m, device=module.device)

    def mixture_weights(
        self, trainer: pl.Trainer, module: MixtureClassifier, client: int
    ) -> Tensor:
        stored = self.client_state(self.view.store, client, "pi")
        return self.uniform(module) if stored is None else stored

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        prior = self.mixture_weights(trainer, pl_module, client)
        log_prior = torch.log(prior).to(pl_module.device)
        q = e_step(pl_module, client_loader(trainer, client, "train"), log_prior)
        pi = update_mixture_weights(q)
        self.set_client_state(state.store, client, "pi", pi.cpu())
        pl_module.log_mixture_weights = torch.log(pi)
        reference = self._frozen_copy(pl_module)
        if self.view.config.vectorize:
            tensors = [t.detach().clone() for t in _tensors(reference)]
            self._started[client] = (log_prior, pl_module.log_mixture_weights, tensors)
        pl_module.responsibilities = self._responsibilities(pl_module, reference, log_prior)

    @staticmethod
    def _responsibilities(module: MixtureClassifier, reference, log_prior: Tensor):
        """q of a batch from the frozen θ^{k−1} and the client's π_t^{k−1}."""

        def responsibilities(x: Tensor, y: Tensor) -> Tensor:
            losses = module.component_losses(x, y, components=reference)
            return torch.softmax(log_prior - losses, dim=1)

        return responsibilities

    def vectorized_client_state(self, trainer, pl_module, clients, state) -> list[Tensor]:
        """log π_t^{k−1} (the E-step prior of q), log π_t^k (the mixture of the training
        accuracy) and the frozen components θ_t^{k−1} of q of every client of the chunk,
        by row."""
        priors, weights, references = zip(*(self._started[c] for c in clients))
        device = pl_module.device
        stacked = [torch.stack(column).to(device) for column in zip(*references)]
        return [torch.stack(priors).to(device), torch.stack(weights).to(device), *stacked]

    @contextmanager
    def vectorized_client_context(self, pl_module, tensors: list[Tensor]):
        saved = pl_module.log_mixture_weights, pl_module.responsibilities
        log_prior, log_pi, *reference = tensors
        pl_module.log_mixture_weights = log_pi
        components = self._functional_components(reference)
        pl_module.responsibilities = self._responsibilities(pl_module, components, log_prior)
        try:
            yield
        finally:
            pl_module.log_mixture_weights, pl_module.responsibilities = saved

    def _functional_components(self, tensors: list[Tensor]) -> list:
        """The frozen components as functions of one client's θ^{k−1} (``tensors``, in
        the order of :func:`_tensors`), for the vmapped loss."""
        components = []
        for component, slots in zip(self._reference, self._component_slots):
            own = {name: tensors[i] for i, name in slots}
            components.append(
                lambda x, c=component, own=own: torch.func.functional_call(c, own, (x,))
            )
        return components

    def _frozen_copy(self, module: MixtureClassifier) -> torch.nn.ModuleList:
        """θ^{k−1}, in eval mode, for the per-batch responsibilities."""
        if self._reference is None:
            self._reference = copy.deepcopy(module.network).eval().requires_grad_(False)
            self._component_slots = [[] for _ in self._reference]
            for i, (name, _) in enumerate(_named_tensors(self._reference)):
                k, inner = name.split(".", 1)
                self._component_slots[int(k)].append((i, inner))
        with torch.no_grad():
            torch._foreach_copy_(_tensors(self._reference), _tensors(module.network))
        return self._reference

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        pl_module.responsibilities = None
        pi = self.client_state(state.store, client, "pi")  # on the rank that trained it
        if pi is not None:
            entropy = -(pi * torch.log(pi.clamp_min(1e-12))).sum()
            sums = state.round_sum(self, "entropy")[0]
            sums[0] += entropy.to(sums)
            sums[1] += 1

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        """Logs ``fedem/pi_entropy``, the mean entropy of the accepted clients' π_t^k
        over every rank's clients (their π may have gone back to another rank by now).
        Flower's server-side mode runs it on the server, which has no module: there it
        only keeps the metric for :meth:`round_metrics`."""
        total, count = state.round_sum(self, "entropy")[0]
        self._entropy = float(total / count) if count > 0 else None
        if pl_module is None:
            return
        pl_module.responsibilities = None
        self._started.clear()
        pl_module.log_mixture_weights = torch.log(self.uniform(pl_module))
        if count > 0:
            pl_module.log(
                "fedem/pi_entropy", total / count, on_epoch=True, batch_size=1,
                sync_dist=trainer.world_size > 1,
            )  # fmt: skip

    def round_metrics(self) -> dict[str, float]:
        """``fedem/pi_entropy`` of the last round (where one of its clients was counted)."""
        return {} if self._entropy is None else {"fedem/pi_entropy": self._entropy}

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        if client in set(trainer.datamodule.unseen_clients):
            pi = self.uniform(pl_module)
            loader = client_loader(trainer, client, "train")
            if loader is not None:
                log_prior = torch.log(pi).to(pl_module.device)
                pi = update_mixture_weights(e_step(pl_module, loader, log_prior))
        else:
            pi = self.mixture_weights(trainer, pl_module, client)
        pl_module.log_mixture_weights = torch.log(pi).to(pl_module.device)

    def on_client_evaluation_end(self, trainer, pl_module, client: int) -> None:
        pl_module.log_mixture_weights = torch.log(self.uniform(pl_module))


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _tensors(module: torch.nn.Module) -> list[Tensor]:
    return [t for _, t in _named_tensors(module)]


__all__ = ["FedEM", "e_step", "update_mixture_weights"]
