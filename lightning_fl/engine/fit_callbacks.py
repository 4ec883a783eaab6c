"""The Trainer's callbacks as a federated fit runs them: the round driver first, the
callbacks that replace the gradient (DP-SGD) before those that add terms to it, one
aggregator (FedAvg when none is given), the federated progress bar and the plots."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_fl.engine.context import Plugins
from lightning_fl.engine.driver import RoundDriver
from lightning_fl.engine.plugins import Aggregator, FedAvg, FederatedCallback
from lightning_fl.engine.progress import FederatedProgressBar
from lightning_fl.plots import FederatedPlots
from lightning_fl.systems.samplers import ClientSampler


def install(callbacks: list[pl.Callback], enable_plots: bool) -> None:
    """Complete and order ``callbacks`` in place (the Trainer's list): a
    :class:`RoundDriver` first, a :class:`FedAvg` unless an aggregator is given (more
    than one is refused), :class:`FederatedPlots` with ``enable_plots``, and the federated
    progress bar in place of Lightning's default one (disabled when stderr is not a
    terminal: a bar in a file or pipe is a line per step)."""
    if not any(isinstance(cb, RoundDriver) for cb in callbacks):
        callbacks.insert(0, RoundDriver())
    if not any(isinstance(cb, Aggregator) for cb in callbacks):
        callbacks.append(FedAvg())
    _the_aggregator(callbacks)
    if enable_plots and not any(isinstance(cb, FederatedPlots) for cb in callbacks):
        callbacks.append(FederatedPlots())
    callbacks.sort(key=_order)  # stable; Lightning runs per-step hooks in list order
    for i, cb in enumerate(callbacks):
        if type(cb) is TQDMProgressBar or _lightnings_default_rich_bar(cb):
            rate = cb.refresh_rate if type(cb) is TQDMProgressBar else 1  # TQDM's default
            callbacks[i] = FederatedProgressBar(refresh_rate=rate, leave=cb._leave)
            if not sys.stderr.isatty():
                callbacks[i].disable()


def _lightnings_default_rich_bar(callback: pl.Callback) -> bool:
    """Lightning's default bar when ``rich`` is installed (flwr installs it): replaced by
    the federated bar, as the TQDM default is; a RichProgressBar a user configured stays."""
    if type(callback) is not RichProgressBar:
        return False

    def settings(bar: RichProgressBar) -> tuple:
        return bar._refresh_rate, bar._leave, bar._console_kwargs, bar.theme

    return settings(callback) == settings(RichProgressBar())


def plugins(callbacks: list[pl.Callback], sampler: ClientSampler) -> Plugins:
    """The fit's plugins: its federated callbacks in the Trainer's order, their one
    aggregator and ``sampler`` as each callback wraps it (``wrap_sampler``)."""
    federated = tuple(cb for cb in callbacks if isinstance(cb, FederatedCallback))
    for cb in federated:
        sampler = cb.wrap_sampler(sampler)
    return Plugins(federated, _the_aggregator(federated), sampler)


def driver(callbacks: list[pl.Callback]) -> RoundDriver:
    """The fit's round driver (installed by :func:`install`)."""
    return next(cb for cb in callbacks if isinstance(cb, RoundDriver))


def _order(cb: pl.Callback) -> int:
    if isinstance(cb, RoundDriver):
        return 0
    return 1 if getattr(cb, "replaces_gradient", False) else 2


def _the_aggregator(callbacks: list[pl.Callback] | tuple[pl.Callback, ...]) -> Aggregator:
    aggregators = [cb for cb in callbacks if isinstance(cb, Aggregator)]
    if len(aggregators) != 1:
        names = ", ".join(type(a).__name__ for a in aggregators) or "none"
        raise ValueError(
            f"Exactly one aggregator callback may decide aggregation, got {names}. "
            "Keep one of them (FedAvg is the default when none is given)."
        )
    return aggregators[0]
