"""The plugins of the composition matrix (issue 24; docs/architecture.md "Plugins compose") and the
runner that combines any two of them on a tiny federation.

A plugin is a named change to a :class:`Setup`: the sampler, a callback, the module, the
datamodule, or how the run executes (vectorized clients, a resume mid-run). The runner
trains two rounds and tests the model; :func:`run_pair` reports whether the pair trained
(and its invariants held) or was refused, and how.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl import (
    MLP,
    AvailableClients,
    Classifier,
    FederatedStrategy,
    FixedClustersSampler,
    FullParticipation,
    MarkovAvailability,
    MDSampler,
    MixtureClassifier,
    PoissonSampler,
    SampleSizeClusteredSampler,
    SimilarityClusteredSampler,
    UniformSampler,
)
from lightning_fl.callbacks import (
    APFL,
    DPSGD,
    SAFARI,
    SCAFFOLD,
    AsynchronousFL,
    CenteredClipping,
    ClusteredFL,
    CoordinateMedian,
    Ditto,
    DPFedAvg,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedEM,
    FedProx,
    FedRep,
    FedYogi,
    FineTune,
    FreeRiderDetector,
    FreeRiders,
    GossipAveraging,
    KNNPer,
    Krum,
    Local,
    MembershipInference,
    PFedMe,
    Pooled,
    SecureAggregation,
    ServerReference,
    SignFlipping,
    TrimmedMean,
    Unlearning,
)
from lightning_fl.datamodules import (
    InMemoryFederatedDataModule,
    ReferenceDataModule,
    StreamingDataModule,
)
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.asynchrony import ClientTimes, FedBuffSchedule
from lightning_fl.systems.samplers import ExcludedClients
from tests.helpers import ACCELERATOR

IN, HIDDEN, OUT = 6, 8, 3
NUM_CLIENTS = 6
ROUNDS = 2
#: Processes of every run: 2 under torchrun (tests/composition_distributed.py).
DEVICES = int(os.environ.get("WORLD_SIZE", "1"))


def _clients(seed: int = 0) -> tuple[list[dict], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, OUT, generator=g)
    clients = []
    for c in range(NUM_CLIENTS):
        n = 6 + 3 * c  # clients c and 5 − c hold 27 samples together
        x = torch.randn(n + 6, IN, generator=g) + 0.3 * c
        y = (x @ w + 0.5 * torch.randn(n + 6, OUT, generator=g)).argmax(1)
        clients.append({"train": (x[:n], y[:n]), "val": (x[n : n + 3], y[n : n + 3]),
                        "test": (x[n + 3 :], y[n + 3 :])})  # fmt: skip
    xs = torch.randn(12, IN, generator=g)
    return clients, (xs, (xs @ w).argmax(1))


def tiny_federation() -> InMemoryFederatedDataModule:
    clients, server = _clients()
    return InMemoryFederatedDataModule(clients, batch_size=4, server=server)


def tiny_reference_federation() -> ReferenceDataModule:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, IN)).astype(np.float32)
    y = (x @ rng.normal(size=(IN, OUT))).argmax(1).astype(np.int64)
    split = (0.4, 0.3, 0.1, 0.2)
    return ReferenceDataModule(x, y, num_clients=NUM_CLIENTS, reference="server", split=split,
                               batch_size=4, eval_batch_size=16)  # fmt: skip


def tiny_classifier() -> Classifier:
    torch.manual_seed(1)
    return Classifier(network=MLP(IN, (HIDDEN,), OUT), lr=0.1)


def tiny_mixture() -> MixtureClassifier:
    torch.manual_seed(1)
    return MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=2, lr=0.1)


@dataclass
class Setup:
    """What one run is made of; plugins change it."""

    sampler: Any = None
    callbacks: list[pl.Callback] = field(default_factory=list)
    strategy: dict[str, Any] = field(default_factory=lambda: {"local_steps": 2, "seed": 0})
    module: Callable[[], pl.LightningModule] = tiny_classifier
    datamodule: Callable[[], Any] = tiny_federation
    resume: bool = False


@dataclass(frozen=True)
class Plugin:
    name: str
    axis: str
    apply: Callable[[Setup], None]


def _sampler(make: Callable[[], Any]) -> Callable[[Setup], None]:
    def apply(setup: Setup) -> None:
        setup.sampler = make()

    return apply


def _callback(make: Callable[[], pl.Callback]) -> Callable[[Setup], None]:
    def apply(setup: Setup) -> None:
        setup.callbacks.append(make())

    return apply


def _mixture(setup: Setup) -> None:
    setup.module = tiny_mixture
    setup.callbacks.append(FedEM())


def _server_reference(setup: Setup) -> None:
    setup.datamodule = tiny_reference_federation
    setup.callbacks.append(ServerReference(w=0.3))


def _streams(setup: Setup) -> None:
    source = setup.datamodule
    setup.datamodule = lambda: StreamingDataModule(source(), rate=3, capacity=6, cache="fifo",
                                                   rounds=ROUNDS)  # fmt: skip


def _detector(setup: Setup) -> None:
    if not any(isinstance(cb, FreeRiders) for cb in setup.callbacks):
        setup.callbacks.append(FreeRiders(1, "plain"))  # the detector needs riders to find
    setup.callbacks.append(FreeRiderDetector())


def _vectorize(setup: Setup) -> None:
    setup.strategy["vectorize"] = True


def _resume(setup: Setup) -> None:
    setup.resume = True


def _unlearning(setup: Setup) -> None:
    setup.callbacks.append(Unlearning("sifu", sigma=0.1, requests={1: [0]}))


PLUGINS: list[Plugin] = [
    Plugin("FullParticipation", "sampler", _sampler(FullParticipation)),
    Plugin("UniformSampler", "sampler", _sampler(lambda: UniformSampler(3))),
    Plugin("MDSampler", "sampler", _sampler(lambda: MDSampler(3))),
    Plugin("SampleSizeClusteredSampler", "sampler",
           _sampler(lambda: SampleSizeClusteredSampler(3))),
    Plugin("SimilarityClusteredSampler", "sampler",
           _sampler(lambda: SimilarityClusteredSampler(3))),
    Plugin("FixedClustersSampler", "sampler",
           _sampler(lambda: FixedClustersSampler([[0, 5], [1, 4], [2, 3]]))),
    Plugin("AvailableClients(ca_fed)", "sampler", _sampler(
        lambda: AvailableClients(MarkovAvailability(0.7, 0.3), "ca_fed", kappa2=0.5))),
    Plugin("ExcludedClients", "sampler",
           _sampler(lambda: ExcludedClients(UniformSampler(3), [1]))),
    Plugin("PoissonSampler", "sampler", _sampler(lambda: PoissonSampler(0.5))),
    Plugin("FedAvg", "aggregator", _callback(lambda: FedAvg(server_lr=0.9))),
    Plugin("FedAvgM", "aggregator", _callback(lambda: FedAvgM(server_lr=0.5))),
    Plugin("FedAdam", "aggregator", _callback(lambda: FedAdam(server_lr=0.05))),
    Plugin("FedYogi", "aggregator", _callback(lambda: FedYogi(server_lr=0.05))),
    Plugin("FedAdagrad", "aggregator", _callback(lambda: FedAdagrad(server_lr=0.05))),
    Plugin("SCAFFOLD", "aggregator", _callback(SCAFFOLD)),
    Plugin("FedProx", "aggregator", _callback(lambda: FedProx(mu=0.1))),
    Plugin("AsynchronousFL", "aggregator", _callback(
        lambda: AsynchronousFL(FedBuffSchedule(2, ClientTimes(50.0))))),
    Plugin("GossipAveraging", "aggregator", _callback(lambda: GossipAveraging("complete"))),
    Plugin("SAFARI", "aggregator", _callback(lambda: SAFARI(q=0.5))),
    Plugin("Pooled", "aggregator", _callback(Pooled)),
    Plugin("Local", "aggregator", _callback(Local)),
    Plugin("DPFedAvg", "aggregator", _callback(lambda: DPFedAvg(
        noise_multiplier=0.5, clip_norm=0.5, target_quantile=0.5, count_std=2.0))),
    Plugin("CoordinateMedian", "aggregator", _callback(CoordinateMedian)),
    Plugin("TrimmedMean", "aggregator", _callback(lambda: TrimmedMean(beta=0.2))),
    Plugin("Krum", "aggregator", _callback(lambda: Krum(num_byzantine=0, num_selected=2))),
    Plugin("CenteredClipping", "aggregator", _callback(lambda: CenteredClipping(tau=0.1))),
    Plugin("FedEM", "personalization", _mixture),
    Plugin("KNNPer", "personalization", _callback(lambda: KNNPer(k=2, backend="torch"))),
    Plugin("Ditto", "personalization", _callback(lambda: Ditto(lam=0.1, personal_lr=0.05))),
    Plugin("APFL", "personalization", _callback(lambda: APFL(alpha=0.5, local_lr=0.05))),
    Plugin("FedRep", "personalization", _callback(lambda: FedRep(head_epochs=1))),
    Plugin("PFedMe", "personalization", _callback(lambda: PFedMe(lam=5.0, inner_steps=2))),
    Plugin("ClusteredFL", "personalization",
           _callback(lambda: ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=0))),
    Plugin("FineTune", "personalization", _callback(lambda: FineTune(lr=0.05))),
    Plugin("DPSGD", "privacy", _callback(lambda: DPSGD(noise_multiplier=0.5))),
    Plugin("ServerReference", "privacy", _server_reference),
    Plugin("MembershipInference", "privacy", _callback(MembershipInference)),
    Plugin("Unlearning", "robustness", _unlearning),
    Plugin("FreeRiders", "robustness", _callback(lambda: FreeRiders(1, "disguised"))),
    Plugin("FreeRiderDetector", "robustness", _detector),
    Plugin("SignFlipping", "robustness", _callback(lambda: SignFlipping(0.34, scale=2.0))),
    Plugin("SecureAggregation", "privacy", _callback(SecureAggregation)),
    Plugin("StreamingDataModule", "streams", _streams),
    Plugin("vectorize", "execution", _vectorize),
    Plugin("resume", "execution", _resume),
]  # fmt: skip
BY_NAME = {p.name: p for p in PLUGINS}

T = Trait
PARTIAL = {T.LEAVES_CLIENTS_OUT, T.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS,
           T.UNKNOWN_INCLUSION_PROBABILITY}  # fmt: skip
ROBUST = {T.READS_EACH_UPDATE, T.IGNORES_THE_UPDATE_SUM, T.STEPS_OTHERWISE_THAN_FEDAVG}
FREE_RIDERS = {T.ADDS_TO_THE_UPDATE_SUM, T.NEEDS_FULL_PARTICIPATION, T.NEEDS_SYNCHRONOUS_ROUNDS}
#: The traits of each plugin of the matrix (tests/composition.py), every object its set-up
#: adds together, written from the papers and the code's behaviour, not from the
#: declarations: a trait dropped from a plugin, or added to one, fails here.
TRAITS_BY_HAND: dict[str, set[str]] = {
    "FullParticipation": set(),
    "UniformSampler": {T.LEAVES_CLIENTS_OUT},
    "MDSampler": PARTIAL,
    "SampleSizeClusteredSampler": PARTIAL,
    "SimilarityClusteredSampler": PARTIAL | {T.READS_EACH_UPDATE},
    "FixedClustersSampler": PARTIAL | {T.FIXED_TO_ITS_TARGET_WEIGHTS},
    "AvailableClients(ca_fed)": PARTIAL,
    "ExcludedClients": {T.LEAVES_CLIENTS_OUT, T.UNKNOWN_INCLUSION_PROBABILITY},
    "PoissonSampler": {T.LEAVES_CLIENTS_OUT, T.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS},
    "FedAvg": set(),
    "FedAvgM": {T.STEPS_OTHERWISE_THAN_FEDAVG},
    "FedAdam": {T.STEPS_OTHERWISE_THAN_FEDAVG},
    "FedYogi": {T.STEPS_OTHERWISE_THAN_FEDAVG},
    "FedAdagrad": {T.STEPS_OTHERWISE_THAN_FEDAVG},
    "SCAFFOLD": {T.STEPS_OTHERWISE_THAN_FEDAVG, T.CORRECTS_EVERY_GRADIENT},
    "FedProx": set(),
    "AsynchronousFL": {T.NEEDS_FULL_PARTICIPATION, T.AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS,
                       T.STEPS_OTHERWISE_THAN_FEDAVG},
    "GossipAveraging": ROBUST | {T.NEEDS_FULL_PARTICIPATION},
    "SAFARI": {T.AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS, T.STEPS_OTHERWISE_THAN_FEDAVG,
               T.TRAINS_ON_SERVER_DATA},
    "Pooled": {T.STEPS_OTHERWISE_THAN_FEDAVG, T.NEEDS_EVERY_CLIENTS_DATA},
    "Local": {T.STEPS_OTHERWISE_THAN_FEDAVG, T.IGNORES_THE_UPDATE_SUM},
    "DPFedAvg": {T.NEEDS_INCLUSION_PROBABILITY, T.BOUNDS_THE_SUMS_SENSITIVITY,
                 T.STEPS_OTHERWISE_THAN_FEDAVG, T.DRAWS_SERVER_RANDOMNESS},
    "CoordinateMedian": ROBUST,
    "TrimmedMean": ROBUST,
    "Krum": ROBUST | {T.NEEDS_MORE_THAN_2F_PLUS_2_CLIENTS},
    "CenteredClipping": ROBUST,
    "FedEM": {T.DECIDES_THE_EVALUATED_MODEL},
    "KNNPer": set(),
    "Ditto": {T.DECIDES_THE_EVALUATED_MODEL},
    "APFL": {T.DECIDES_THE_EVALUATED_MODEL},
    "FedRep": {T.DECIDES_THE_EVALUATED_MODEL, T.FREEZES_PART_OF_THE_MODEL},
    "PFedMe": {T.DECIDES_THE_EVALUATED_MODEL, T.STEPS_FROM_NON_PRIVATE_GRADIENTS},
    "ClusteredFL": ROBUST | {T.NEEDS_FULL_PARTICIPATION, T.DECIDES_THE_EVALUATED_MODEL,
                             T.COMPARES_UPDATES_IN_ONE_PLACE},
    "FineTune": {T.DECIDES_THE_EVALUATED_MODEL},
    "DPSGD": {T.PRIVATIZES_EACH_GRADIENT},
    "ServerReference": {T.ADDS_TO_THE_UPDATE_SUM, T.READS_THE_SERVER_REFERENCE,
                        T.HAS_NO_SERVER_DATA},  # the ReferenceDataModule's
    "MembershipInference": set(),
    "Unlearning": {T.LEAVES_CLIENTS_OUT, T.NEEDS_THE_FEDAVG_STEP, T.CHANGES_TARGET_WEIGHTS},
    "FreeRiders": FREE_RIDERS,
    "FreeRiderDetector": FREE_RIDERS | {T.READS_EACH_UPDATE, T.COMPARES_UPDATES_IN_ONE_PLACE},
    "SignFlipping": set(),
    "SecureAggregation": {T.HIDES_EACH_UPDATE},
    "StreamingDataModule": {T.NEEDS_EVERY_CLIENTS_DATA, T.HAS_NO_SERVER_DATA,
                            T.HAS_NO_SERVER_REFERENCE},
    "vectorize": set(),
    "resume": set(),
}  # fmt: skip
#: Runs of tests/composition_distributed.py: every plugin alone, and each plugin whose
#: client state moves to the rank that trains the client, with a sampler that makes ranks
#: train clients they do not own (alone, every plugin trains all 6 clients for 2 steps,
#: which the split by steps gives to their owners).
DISTRIBUTED_RUNS = [p.name for p in PLUGINS] + [
    f"UniformSampler+{name}"
    for name in ("SCAFFOLD", "FedEM", "Ditto", "APFL", "FedRep", "PFedMe", "DPSGD", "Local")
]
#: The words by which a refusal may name a plugin, besides its name.
ALIASES: dict[str, tuple[str, ...]] = {
    "AvailableClients(ca_fed)": ("AvailableClients", "CA-Fed"),
    "FedEM": ("FedEM", "MixtureClassifier"),
    "ServerReference": ("ServerReference", "ReferenceDataModule"),
    "StreamingDataModule": ("StreamingDataModule",),
    "vectorize": ("vectorize",),
    "resume": ("resum", "checkpoint"),
    "FreeRiderDetector": ("FreeRiderDetector", "FreeRiders"),
}


def names_plugin(message: str, name: str) -> bool:
    return any(word in message for word in ALIASES.get(name, (name,)))


def pairs() -> list[tuple[str, str]]:
    """Every pair of plugins, except two samplers (a run has one sampler)."""
    out = []
    for i, a in enumerate(PLUGINS):
        for b in PLUGINS[i + 1 :]:
            if a.axis == b.axis == "sampler":
                continue
            out.append((a.name, b.name))
    return out


class _TrainingSeen(pl.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps += 1


@dataclass
class Outcome:
    """``"ok"``, ``"refused"`` (at setup, before any training step) or ``"failed"``."""

    status: str
    message: str = ""
    params: list[torch.Tensor] | None = None
    weights: list[tuple[int, tuple[int, ...], tuple[float, ...]]] = field(default_factory=list)
    #: the scalar metrics of the last training round and of the test
    metrics: dict[str, float] = field(default_factory=dict)


def build(names: tuple[str, ...]) -> Setup:
    setup = Setup()
    for name in names:
        BY_NAME[name].apply(setup)
    return setup


def _trainer(setup: Setup, rounds: int, root: str, extra: list, **kw) -> pl.Trainer:
    strategy = dict(setup.strategy)
    if DEVICES > 1:
        strategy["timeout"] = 120.0
    options = dict(
        devices=DEVICES,
        default_root_dir=root, max_epochs=rounds, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, accelerator=ACCELERATOR,
        strategy=FederatedStrategy(sampler=setup.sampler, enable_plots=False, **strategy),
        callbacks=[*setup.callbacks, *extra],
    )  # fmt: skip
    options.update(kw)
    return pl.Trainer(**options)


class _Weights(pl.Callback):
    """Each round's participants and aggregation weights."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, tuple[int, ...], tuple[float, ...]]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.current_round.state
        part = state.participation
        self.rows.append((state.round_idx, part.clients, part.weights))


def run(names: tuple[str, ...], rounds: int = ROUNDS) -> Outcome:
    """Train ``rounds`` rounds with the plugins ``names`` and test the model once; with
    ``resume``, train half, checkpoint, and resume a fresh run from it to the end."""
    setup = build(names)
    seen, weights = _TrainingSeen(), _Weights()
    module, dm = setup.module(), setup.datamodule()
    shared = os.environ.get("COMPOSITION_ROOT")  # every rank's, for a shared checkpoint
    if shared:
        root = os.path.join(shared, "+".join(names))
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="lightning-fl-composition-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if setup.resume:
                from lightning.pytorch.callbacks import ModelCheckpoint

                first = rounds // 2
                ckpt = ModelCheckpoint(root, "first", save_top_k=-1, every_n_epochs=first)
                _trainer(setup, first, root, [seen, weights, ckpt],
                         enable_checkpointing=True).fit(module, datamodule=dm)  # fmt: skip
                setup = build(names)  # fresh plugins, as a new process would have
                module, dm = setup.module(), setup.datamodule()
                torch.manual_seed(12345)  # the checkpoint, not this seed, must decide
                trainer = _trainer(setup, rounds, root, [seen, weights])
                trainer.fit(module, datamodule=dm, ckpt_path=os.path.join(root, "first.ckpt"),
                            weights_only=True)  # fmt: skip
            else:
                trainer = _trainer(setup, rounds, root, [seen, weights])
                trainer.fit(module, datamodule=dm)
            metrics = _scalars(trainer.callback_metrics)  # the last round's
            trainer.test(module, datamodule=dm, verbose=False)
            metrics.update(_scalars(trainer.callback_metrics))
    except Exception as err:  # noqa: BLE001 - reported, the matrix test decides
        status = "refused" if seen.steps == 0 else "failed"
        return Outcome(status, f"{type(err).__name__}: {err}")
    finally:
        if not shared:  # the run's own folder: nothing is left behind in the temp folder
            shutil.rmtree(root, ignore_errors=True)
    params = [p.detach().clone() for p in module.parameters()]
    return Outcome("ok", params=params, weights=weights.rows, metrics=metrics)


def _scalars(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v.numel() == 1}


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":  # survey: python -m tests.composition [names...]
    import sys
    import time

    quiet()
    chosen = [tuple(sys.argv[1:])] if len(sys.argv) > 1 else pairs()
    start = time.perf_counter()
    for pair in chosen:
        outcome = run(pair)
        finite = outcome.params is None or all(bool(p.isfinite().all()) for p in outcome.params)
        print(f"{' + '.join(pair)}\t{outcome.status}\t{'' if finite else 'NONFINITE'}\t"
              f"{outcome.message[:300]}")  # fmt: skip
    print(f"{len(chosen)} runs in {time.perf_counter() - start:.1f} s", file=sys.stderr)
