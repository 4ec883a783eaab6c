"""Reference-data privacy: membership-inference evaluation of training and reference data,
WERM with the reference data at the server, and DP-SGD as the comparison defense
(Kaplan et al., PETS 2024; Marfoq thesis §1.6.1)."""

from __future__ import annotations

import csv
import functools
import os
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_fl.checks import require_rate
from lightning_fl.engine import collectives
from lightning_fl.engine.local_training import batches, client_loader, evaluation_mode, sgd
from lightning_fl.engine.outputs import run_dir
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.seeding import derive_seed, generator, seed_global_rng
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.membership import ATTACKS, membership_inference
from lightning_fl.systems.privacy_noise import secret_generator


def predict_proba(module: pl.LightningModule, loader: DataLoader | None) -> tuple[Tensor, Tensor]:
    """Softmax outputs and labels of every sample of ``loader`` (eval mode)."""
    if loader is None:
        # host: the outputs below are moved to the host too
        return torch.empty(0, 0), torch.empty(0, dtype=torch.long)
    probs, labels = [], []
    with evaluation_mode(module):
        for x, y in batches(loader, module.device):
            probs.append(torch.softmax(module(x).float(), dim=-1).cpu())
            labels.append(y.cpu())
    return torch.cat(probs), torch.cat(labels)


class MembershipInference(FederatedCallback):
    """Attacks every evaluated client's data and reports the privacy "triad" next to the
    test accuracy the module logs:

    - ``mia/train/<attack>``: members = the client's training data, non-members = its
      held-out test data;
    - ``mia/reference/<attack>``: members = its reference data (split ``"reference"``),
      non-members = its held-out test data; with the reference data at the server
      (``ReferenceDataModule(reference="server")``), the server's reference data against
      the pooled test data, with the global model;
    - ``.../best``: the strongest attack's accuracy; ``.../auc``: the largest of the
      attacks' ROC AUCs (threshold-free, :func:`~lightning_fl.systems.membership.roc_auc`).

    Attacks (:mod:`lightning_fl.systems.membership`): Song & Mittal's correctness, confidence,
    entropy and modified-entropy attacks with per-class thresholds, and Yeom et al.'s loss
    threshold; thresholds are fitted on one half of a balanced member/non-member set and
    scored on the other half. Values are averaged over clients (uniformly).

    Under personalization the global model is attacked before the personalization
    callbacks adapt a client (``mia/...``) and the personalized model after
    (``mia_personal/...``). It runs at every validation (``"validate"``, i.e. every round
    with validation) and test, and writes ``<log_dir>/membership_inference.csv``.
    """

    module_methods = ("forward(x) -> logits",)
    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    evaluation_observer = True

    def __init__(
        self,
        attacks: tuple[str, ...] = ATTACKS,
        stages: tuple[str, ...] = ("validate", "test"),
        seed: int = 0,
    ) -> None:
        unknown = set(attacks) - set(ATTACKS)
        if unknown:
            raise ValueError(f"Unknown attacks {sorted(unknown)}; choose from {ATTACKS}.")
        self.attacks, self.stages, self.seed = tuple(attacks), tuple(stages), seed
        self.results: dict[tuple[str, str, int], dict[str, float]] = {}

    def _active(self, trainer: pl.Trainer) -> bool:
        stage = "test" if trainer.testing else "validate"
        return stage in self.stages and not trainer.sanity_checking

    def _attack(self, module, trainer, client: int, model: str) -> None:
        nonmember = predict_proba(module, client_loader(trainer, client, "test"))
        if len(nonmember[1]) < 2:
            return
        for target in ("train", "reference"):
            member = predict_proba(module, client_loader(trainer, client, target))
            if len(member[1]) < 2:
                continue
            result = membership_inference(*member, *nonmember, seed=self.seed, attacks=self.attacks)
            self.results[(model, target, client)] = dict(
                result.accuracy, best=result.best, auc=result.best_auc
            )

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        if self._active(trainer):
            self._attack(pl_module, trainer, client, "mia")

    def on_client_evaluation_end(self, trainer, pl_module, client: int) -> None:
        if self._active(trainer) and self.view.evaluation.personalizes:
            self._attack(pl_module, trainer, client, "mia_personal")

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.results.clear()

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.results.clear()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self._active(trainer):
            self._report(trainer, pl_module)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self._active(trainer):
            self._report(trainer, pl_module)

    def _server_attack(self, trainer, module) -> None:
        dm = trainer.datamodule
        if getattr(dm, "reference", None) != "server" or not trainer.is_global_zero:
            return
        member = predict_proba(
            module, DataLoader(dm.server_reference(), batch_size=dm.eval_batch_size)
        )
        nonmember = predict_proba(
            module, DataLoader(dm.server_nonmembers(), batch_size=dm.eval_batch_size)
        )
        result = membership_inference(*member, *nonmember, seed=self.seed, attacks=self.attacks)
        self.results[("mia", "reference", -1)] = dict(
            result.accuracy, best=result.best, auc=result.best_auc
        )

    def _report(self, trainer, pl_module) -> None:
        self.view.evaluation.end_client()
        self._server_attack(trainer, pl_module)
        results = dict(self.results)
        if (group := collectives.across_ranks(trainer.world_size)) is not None:
            parts = group.all_gather_object(results)
            results = {k: v for part in parts for k, v in part.items()}
        grouped: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
        for (model, target, _client), values in results.items():
            grouped[(model, target)].append(values)
        for (model, target), rows in sorted(grouped.items()):
            for attack in [*self.attacks, "best", "auc"]:
                mean = sum(r[attack] for r in rows) / len(rows)
                pl_module.log(f"{model}/{target}/{attack}", mean, sync_dist=True)
        if results and trainer.is_global_zero:
            log_dir = run_dir(trainer)
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "membership_inference.csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(
                        ["stage", "round", "model", "data", "client", *self.attacks, "best", "auc"]
                    )
                stage = "test" if trainer.testing else "val"
                for (model, target, client), values in sorted(results.items()):
                    writer.writerow(
                        [stage, trainer.current_epoch, model, target, client]
                        + [f"{values[a]:.6f}" for a in [*self.attacks, "best", "auc"]]
                    )


class ServerReference(FederatedCallback):
    """WERM in FL with the reference data at the server: the server takes part in every
    round as one more "client" holding the reference data, with aggregation weight w,
    while the clients' weights are scaled by 1 − w. FedAvg then minimizes
    (1 − w)·Σ_i p_i L_i(θ) + w·L_ref(θ), the WERM objective over the federation's training
    data and the server's reference data.

    The server's local work is plain SGD at the clients' learning rate of the round (the
    first parameter group's, so an lr schedule applies to it too) for the strategy's
    ``local_steps`` (or one pass over the reference data with ``local_epochs``), from the
    round's global model; its reference order and its dropout masks are seeded from
    (seed, round), so vectorized clients give the same model as sequential ones. Needs
    ``ReferenceDataModule(reference="server")`` or any datamodule with
    ``server_reference()``.
    """

    traits = {
        Trait.ADDS_TO_THE_UPDATE_SUM: (
            "aggregate with FedAvg or a server optimizer, or drop ServerReference"
        ),
        Trait.READS_THE_SERVER_REFERENCE: "",
    }

    supports_vectorized_clients = True  # the server trains at round start, sequentially

    requires_task_loss = True

    def __init__(self, w: float = 0.5, batch_size: int | None = None) -> None:
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"The WERM weight w must be in [0, 1], got {w}.")
        self.w, self.batch_size = w, batch_size

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if self.w == 0.0 or trainer.global_rank != 0:  # the server's term is added once
            return
        dm = trainer.datamodule
        if not hasattr(dm, "server_reference"):
            raise TypeError(
                f"{type(dm).__name__} has no server_reference(): use reference='server'."
            )
        config = self.view.config
        loader = DataLoader(
            dm.server_reference(),
            batch_size=self.batch_size or dm.batch_size,
            shuffle=True,
            generator=generator(config.seed, "server_reference", state.round_idx),
        )
        steps = config.local_steps
        model = self.view.tensors
        params = list(pl_module.parameters())
        # its own dropout draws, as a client's: not what the last client left in the RNG
        seed_global_rng(derive_seed(config.seed, "server_reference", state.round_idx),
                        pl_module.device)  # fmt: skip
        lr = trainer.optimizers[0].param_groups[0]["lr"]  # the round's, after any schedule
        if steps is None:
            sgd(pl_module, params, loader, lr, epochs=config.local_epochs)
        else:
            sgd(pl_module, params, _Cycled(loader, steps), lr, epochs=1)
        server_update = model.minus(state.global_tensors)
        torch._foreach_add_(state.update_sum, server_update, alpha=self.w)
        model.load_(state.global_tensors)

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        return torch._foreach_mul(update, 1.0 - self.w)


class _Cycled:
    """Exactly ``steps`` batches of ``loader``, reshuffling at every pass."""

    def __init__(self, loader: DataLoader, steps: int) -> None:
        self.loader, self.steps = loader, steps

    def __iter__(self):
        from lightning_fl.engine.schedule import cycle_batches

        return cycle_batches(self.loader, self.steps)


#: The data sources DP-SGD accounts for, each client's separately: its own training data,
#: and WERM's reference data (thesis §6.3).
ACCOUNTED_SOURCES = ("train", "reference")


class DPSGD(FederatedCallback):
    """DP-SGD (Abadi et al., CCS 2016) for every client's local steps: per-sample gradients
    clipped to norm C, Gaussian noise N(0, σ²C²) added to their sum, divided by the batch
    size; the optimizer then steps with that gradient. Privacy is accounted with Opacus's
    RDP accountant per client (ε at ``delta``; the largest over clients is logged as
    ``dp/epsilon``), with the nominal sampling rate B/n (B the largest batch seen, so a
    last partial batch does not lower it).

    With WERM batches ({"train", "reference"}), the two datasets get their own noise:
    g = (1 − w)·(Σ clip(g_i) + σ_train C ξ)/B + w·(Σ clip(g_j) + σ_ref C ξ')/B_ref, and
    each has its own accountant (``dp/epsilon``, ``dp/epsilon_reference``).

    Per-sample gradients use ``torch.func`` (``vmap`` of ``grad``) over the module's
    ``criterion``; models with BatchNorm are refused (as in Opacus). Batches are shuffled
    fixed-size batches, not Poisson samples: the reported ε is the usual approximation.

    The private gradient replaces the batch's gradient before other callbacks add their
    data-independent terms (FedProx, SCAFFOLD: ``replaces_gradient``).

    Vectorized clients (``vectorize=True``): per-sample gradients of every client row at
    once (a vmap over the rows of a vmap over the samples), clipped per sample, and each
    row's noise drawn from that client's generator, seeded with (seed, round, client) as
    the sequential path seeds the global one, in the same order (parameter by parameter):
    the result equals the sequential run's. WERM's two-source batches are refused there.

    Where the sites are separate institutions (``FederatedStrategy(silos=...)``), or the
    fit is one site's part of a deployment (``secret_randomness=True``: a Flower
    ClientApp's in the server-side mode), the noise comes from a generator of the site's
    own, seeded at each fit from the operating system's entropy
    (:func:`~lightning_fl.systems.privacy_noise.secret_generator`), not from the recipe's
    seed: no other party can draw it again. A simulation's noise is its
    seed's, reproducible by anyone with it.
    """

    traits = {Trait.PRIVATIZES_EACH_GRADIENT: ""}

    replaces_gradient = True
    module_methods = ("forward(x) -> logits", "criterion(logits, target) -> loss")
    supports_vectorized_clients = True

    def __init__(
        self,
        noise_multiplier: float = 1.0,
        max_grad_norm: float = 1.0,
        reference_noise_multiplier: float | None = None,
        delta: float = 1e-5,
    ) -> None:
        require_rate("noise_multiplier", noise_multiplier, 1.0, allow_zero=True)
        require_rate("max_grad_norm", max_grad_norm, 1.0)
        self.sigma, self.clip, self.delta = noise_multiplier, max_grad_norm, delta
        self.sigma_reference = (
            noise_multiplier if reference_noise_multiplier is None else reference_noise_multiplier
        )
        for source in ACCOUNTED_SOURCES:  # each client's accounting, per data source
            for fact in ("steps", "rate", "sigma"):  # noisy steps, max q, min z
                self.add_client_state(f"{source}_{fact}", key=f"dp_{source}_{fact}")
        self._batch: Any = None
        self._sizes: dict[tuple[int, str], int] = {}
        self._secret: torch.Generator | None = None  # silo mode's noise generator

    def on_fit_start(self, trainer, pl_module) -> None:
        self._sizes.clear()
        self._secret = None
        if self.view is not None and self.view.config.secret_randomness:
            self._secret = secret_generator(pl_module.device)
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in pl_module.modules()):
            raise ValueError(
                "DPSGD cannot clip per-sample gradients through BatchNorm: use GroupNorm."
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch = batch

    def _sources(self, module) -> list[tuple[str, Any, float, float]]:
        """(name, batch, loss weight, noise multiplier) of each data source in the batch."""
        if isinstance(self._batch, dict):
            w = float(module.hparams.w)
            reference = self._batch["reference"]
            sources = [
                ("train", self._batch["train"], 1.0 - w, self.sigma),
                ("reference", reference, w, self.sigma_reference),
            ]
            return [s for s in sources if s[2] > 0.0]
        return [("train", self._batch, 1.0, self.sigma)]

    def per_sample_gradients(self, module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        params = {n: p.detach() for n, p in module.named_parameters()}
        buffers = dict(module.named_buffers())

        def loss_of_one(p, xi, yi):
            out = torch.func.functional_call(module, (p, buffers), (xi.unsqueeze(0),))
            return module.criterion(out, yi.unsqueeze(0))

        return torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)

    def clipped_sum(self, grads: list[Tensor], rows: bool = False) -> list[Tensor]:
        """Σ_i clip_C(g_i): each sample's gradient (over all parameters) scaled to norm at
        most C, summed over the samples, dimension 0 of ``grads``, or dimension 1 with
        ``rows`` (one sum per client row)."""
        lead = grads[0].shape[: 2 if rows else 1]
        norms = torch.sqrt(sum(g.reshape(*lead, -1).pow(2).sum(-1) for g in grads))
        factor = (self.clip / (norms + 1e-6)).clamp(max=1.0)
        spec = "rb,rb...->r..." if rows else "i,i...->..."
        return [torch.einsum(spec, factor, g) for g in grads]

    def private_gradient(self, module, x: Tensor, y: Tensor, sigma: float) -> dict[str, Tensor]:
        """(Σ_i clip_C(g_i) + N(0, σ²C²)) / B."""
        grads = self.per_sample_gradients(module, x, y)
        out = {}
        for name, summed in zip(grads, self.clipped_sum(list(grads.values()))):
            noise = torch.normal(0.0, sigma * self.clip, size=summed.shape, device=summed.device,
                                 generator=self._secret)  # fmt: skip
            out[name] = (summed + noise) / len(x)
        return out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        client = trainer.strategy.training_client
        if self._batch is None or len(self._batch) == 0 or client is None:
            return  # an idle (padding) batch
        total: dict[str, Tensor] = {}
        for name, (x, y), weight, sigma in self._sources(pl_module):
            gradient = self.private_gradient(pl_module, x, y, sigma)
            for key, value in gradient.items():
                total[key] = total.get(key, 0.0) + weight * value
            self._record(trainer, client, name, sigma, len(y))
        for key, p in pl_module.named_parameters():
            if key in total:
                p.grad = total[key].to(p.dtype)

    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        """(Σ_i clip_C(g_{c,i}) + N(0, σ²C²)) / B for every client row c at once."""
        step = state.vectorized_step
        if isinstance(step.batch, dict):
            from lightning_fl.engine.vectorized import VectorizationError

            raise VectorizationError(
                "DPSGD with WERM's {'train', 'reference'} batches runs client by client: "
                "use FederatedStrategy(vectorize=False)."
            )
        x, y = step.batch
        names = self.view.tensors.param_names
        buffers = dict(pl_module.named_buffers())

        def loss_of_one(tensors, xi, yi):
            named = dict(zip(names, tensors))
            out = torch.func.functional_call(pl_module, (named, buffers), (xi.unsqueeze(0),))
            return pl_module.criterion(out, yi.unsqueeze(0))

        per_sample = torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))
        sample_grads = torch.func.vmap(per_sample)(list(params), x, y)  # [rows, B, ...] each
        size = y.shape[1]
        summed = self.clipped_sum(list(sample_grads), rows=True)
        for row, gen in enumerate(step.generators):
            for total in summed:
                noise = torch.normal(
                    0.0, self.sigma * self.clip, size=total[row].shape,
                    generator=self._secret or gen, device=total.device,
                )  # fmt: skip
                total[row] += noise
        for j, total in enumerate(summed):
            value = (total / size).to(params[j].dtype)
            if grads[j] is None:  # a parameter the loss does not use: its noise, as p.grad
                grads[j] = value  # gets it on the sequential path
            else:
                grads[j].copy_(value)
        for row in rows:
            self._record(trainer, state.chunk.clients[row], "train", self.sigma, size)

    def _record(self, trainer, client: int, source: str, sigma: float, batch_size: int) -> None:
        """Count one noisy step of ``source`` for ``client``. The sampling rate is the
        nominal one, B/n with B the largest batch seen: a last, partial batch has a lower
        rate, and accounting with it would under-report ε."""
        n = self._sizes.get((client, source))
        if n is None:  # once per fit and client, not per step
            dm = trainer.datamodule
            dataset = dm.client_dataset(client, "train")
            n = self._sizes[(client, source)] = (
                len(dataset.reference) if source == "reference" else len(dataset)
            )
        store = self.view.store

        def fact(name: str, default: Any = None) -> Any:
            value = self.client_state(store, client, f"{source}_{name}")
            return default if value is None else value

        self.set_client_state(store, client, f"{source}_steps", fact("steps", 0) + 1)
        rate = max(min(1.0, batch_size / max(n, 1)), fact("rate", 0.0))
        self.set_client_state(store, client, f"{source}_rate", rate)
        # the smallest noise seen: a changed multiplier never makes ε look smaller
        previous = fact("sigma")
        smallest = float(sigma if previous is None else min(previous, sigma))
        self.set_client_state(store, client, f"{source}_sigma", smallest)

    def epsilon(self, store, client: int, source: str = "train") -> float:
        """``client``'s ε at ``delta`` for its data ``source`` (its declared accounting)."""
        steps = self.client_state(store, client, f"{source}_steps")
        sigma = self.client_state(store, client, f"{source}_sigma")
        if not steps or sigma is None:
            return 0.0
        if sigma == 0:
            return float("inf")
        rate = self.client_state(store, client, f"{source}_rate")
        return rdp_epsilon(sigma, rate, steps, self.delta)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Logs the largest ε over the clients that trained so far (``dp/epsilon``, and
        ``dp/epsilon_reference`` for WERM's reference data). Each rank's client store holds
        its own clients: on several processes the ranks' maxima are gathered first (one
        ``all_gather_object`` a round), so every rank logs the largest over all clients."""
        store = self.view.store
        sources = tuple(zip(ACCOUNTED_SOURCES, ("dp/epsilon", "dp/epsilon_reference")))
        largest: list[float | None] = []
        for source, _ in sources:
            values = [v for v in (self.epsilon(store, c, source) for c in store.clients()) if v > 0]
            largest.append(max(values) if values else None)
        group = collectives.across_ranks(trainer.world_size)
        synced = group is not None
        if group is not None:
            parts = group.all_gather_object(largest)
            largest = [max((p[i] for p in parts if p[i] is not None), default=None)
                       for i in range(len(sources))]  # fmt: skip
        for (_, name), value in zip(sources, largest):
            if value is not None:
                pl_module.log(name, value, on_epoch=True, sync_dist=synced)  # equal on all ranks


@functools.lru_cache(maxsize=4096)
def rdp_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    """ε of ``steps`` subsampled Gaussian steps (noise multiplier ``sigma``, sampling rate
    ``rate``) at ``delta``, by Opacus's RDP accountant. Cached: one Opacus call costs about
    0.3 s on a CPU, and clients that share (σ, q, steps) share ε, so a round's maximum
    over hundreds of clients costs a few new calls instead of hundreds."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(sigma, rate, steps)]
    return float(accountant.get_epsilon(delta))


__all__ = ["DPSGD", "MembershipInference", "ServerReference"]
