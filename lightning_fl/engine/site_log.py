"""A site's own account of the run, in silo mode (README, "Deploying across hospitals",
"Following the run").

Lightning writes a run's logs and progress bar on rank 0 only, so without this the other
sites' consoles stay silent for the whole run. Every site writes one line when its fit
starts (a fresh run, or the round it resumes from) and one per round, on its console and
in its own run folder, ``<run folder>/sites/<site>.log`` (appended, so a resumed run
continues the file)::

    site 'hungary': run 3f2a9c0d1e5b, resumed from its checkpoint of round 4: rounds 5-14 to train
    site 'hungary': round 5/14: trained clients [1] of 4 participants; train_loss 0.5321

The round's line is written when the round's metrics are known (the module logs the
round's means after the callbacks' epoch end): at the next round's start, or at the fit's
end. Values are host-side: they were logged already.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: the metrics a round's line shows, when the run logs them (the round's training mean,
#: the validation means over clients)
SHOWN = ("train_loss",)
SHOWN_PREFIX = "val_"


@dataclass(frozen=True)
class FinishedRound:
    """What a site knows of a round when it ends: the round, the clients it trained, and
    the round's participants and dropped updates over all sites."""

    round_idx: int
    trained: tuple[int, ...]
    participants: int
    dropped: int


class SiteLog:
    """One site's lines: ``path`` is its log file, ``last_round`` the fit's last round
    (``max_epochs - 1``, as Lightning's progress bar counts), ``echo`` its console."""

    def __init__(
        self, site: str, path: str, last_round: int, echo: Callable[[str], None] = print
    ) -> None:
        self.site, self.path, self.last_round, self.echo = site, path, last_round, echo
        self._pending: FinishedRound | None = None

    def say(self, text: str) -> None:
        line = f"site {self.site!r}: {text}"
        self.echo(line)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(line + "\n")

    def fit_started(self, run_id: str | None, first_round: int, resumed: bool) -> None:
        """The fit's first line: a fresh run, or the round of the checkpoint it resumes
        from (``first_round`` is the first round it trains)."""
        run = f"run {run_id[:12]}" if run_id else "run"
        todo = f"rounds {first_round}-{self.last_round} to train"
        if first_round > self.last_round:
            todo = "no round left to train"
        if resumed:
            self.say(f"{run}, resumed from its checkpoint of round {first_round - 1}: {todo}")
        else:
            self.say(f"{run} starts: {todo}")

    def round_ended(self, finished: FinishedRound) -> None:
        """Hold the round's line until its metrics are logged (:meth:`flush`)."""
        self._pending = finished

    def flush(self, metrics: Mapping[str, object]) -> None:
        """Write the held round's line with ``metrics`` (``trainer.callback_metrics``)."""
        finished, self._pending = self._pending, None
        if finished is None:
            return
        text = (
            f"round {finished.round_idx}/{self.last_round}: trained clients "
            f"{list(finished.trained)} of {finished.participants} participants"
        )
        if finished.dropped:
            text += f" ({finished.dropped} dropped updates)"
        shown = _shown(metrics)
        if shown:
            text += "; " + ", ".join(f"{name} {value:.4g}" for name, value in shown)
        self.say(text)


def _shown(metrics: Mapping[str, object]) -> list[tuple[str, float]]:
    """The round's training loss and the validation means (``val_loss``, ``val_acc``:
    one underscore; not their uniform or bottom-decile variants), in a fixed order."""
    names = [n for n in SHOWN if n in metrics]
    names += sorted(n for n in metrics if n.startswith(SHOWN_PREFIX) and n.count("_") == 1)
    return [(name, float(metrics[name])) for name in names]


def trained_here(clients: Sequence[int], trained_by: Sequence[int] | None, rank: int):
    """The participants that ``rank`` trained (``trained_by``: each one's rank)."""
    if trained_by is None:
        return tuple(clients)
    return tuple(c for c, r in zip(clients, trained_by) if r == rank)
