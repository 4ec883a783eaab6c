"""A site that dropped comes back, without restarting the others (issue 76).

On a transport that lets sites drop (``FlowerSite(min_sites=m)``), the sites that remain
keep, at each round's end while a site is missing, what a site that comes back resumes
from, and ask, at the next round's start, whether a dropped site is back
(:meth:`~lightning_fl.engine.collectives.Collectives.rejoining`). A dropped site comes
back by starting its fit again with ``--ckpt_path last``: its own checkpoint shard (its
clients' store, which never left it) and the run's identity. Its SuperNode must be the
one it had (the server knows the site by its node).

Its set-up then runs its usual collectives, and the others answer each of them at the
round's start, in the same order (:class:`Welcome`):

1. the sites' names and recipes, checked together (a site started with another recipe
   is refused, on every site);
2. the resume agreement, in which the lowest-ranked of the others hands it the run's
   global part as of the last round's end, taken then as ``ModelCheckpoint`` takes it
   (the model, the optimizer and server state, the sampler's state and every callback's
   server-side state: a checkpoint less the client store), and all check that its shard
   is of this run and not of a later round (on its side:
   :func:`~lightning_fl.engine.silo_checkpoints.rejoined_checkpoint`);
3. the broadcast of the initial model (rank 0's: the same global model on every site);
4. every site's sample counts.

Lightning then restores the global part with its own clients' store, and its next
round is the others' next round. Its clients missed the rounds it was away: their
updates were dropped updates there, and their store is as its checkpoint left it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_fl.engine import collectives
from lightning_fl.engine.context import FitContext, silo_counts
from lightning_fl.engine.silo_checkpoints import DRIVER_KEY, check_joining, split_off_shard
from lightning_fl.engine.silo_sites import check_peers, site_recipe


@dataclass(frozen=True)
class Welcome:
    """What the sites that remain hand a site that is back: the global part of the last
    round's checkpoint, taken at that round's end (:meth:`at_round_end`, while a site is
    missing), and their answers to its set-up (:meth:`run`, at the next round's start,
    after the last round's collectives)."""

    trainer: pl.Trainer
    fit: FitContext
    run_id: str | None
    group: collectives.Collectives
    checkpoint: dict[str, Any]

    @classmethod
    def at_round_end(cls, trainer: pl.Trainer, fit: FitContext, run_id: str | None) -> Welcome:
        """The round's checkpoint, as Lightning's ``ModelCheckpoint`` takes it at the
        round's end, less this site's client store (which never leaves it)."""
        ranks = fit.ranks
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        split_off_shard(checkpoint, ranks.rank, ranks.world_size)
        group = collectives.across_ranks(ranks.world_size)
        return cls(trainer, fit, run_id, group, checkpoint)

    def run(self, joining: list[int]) -> None:
        """Answer the set-up collectives of the sites ``joining`` (ranks), in their order
        (the module's docstring)."""
        trainer, fit, group = self.trainer, self.fit, self.group
        ranks, names = fit.ranks, fit.site_names
        label = names[ranks.rank] if names else f"silo {ranks.rank}"
        check_peers(label, site_recipe(trainer, fit.config, names), ranks.world_size)
        ended = self.checkpoint["callbacks"][DRIVER_KEY]["round"]
        giver = min(
            r for r in range(ranks.world_size) if r not in joining and r not in group.dropped
        )
        offer = self.checkpoint if ranks.rank == giver else None  # one copy crosses, not W − 1
        sites = group.all_gather_object((label, None, self.run_id, ended, offer))
        for rank in joining:
            check_joining(sites[rank], self.run_id, ended)
        collectives.broadcast_module(fit.module, group)
        group.all_gather_object(silo_counts(fit.datamodule))
        joined = ", ".join(repr(names[r]) if names else f"rank {r}" for r in joining)
        print(f"site {joined} rejoins the run at round {trainer.current_epoch}.", flush=True)
