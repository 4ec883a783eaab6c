"""Sites known by name (``FederatedStrategy(silos=["cleveland", "hungarian", ...])``).

A launcher numbers processes its own way: under torchrun's c10d rendezvous, agents started
with node ranks 3, 2, 1, 0 get global ranks 0, 1, 2, 3 (torch sorts them by host name and
pid), so "node rank r holds center r" cannot be arranged across institutions. With named
silos each site starts with its own name (``lightning-fl fit --silo cleveland``, or
``LIGHTNING_FL_SILO=cleveland``) and its rank becomes its name's place in the recipe's
list, whatever the launcher said: silo i holds the clients c with c % len(names) == i, its
data folder may be named after it (``root: data/heart/{silo}``) and its checkpoint shard
lies in a folder of its own (:mod:`.silo_checkpoints`).

At set-up every site sends the others its name and a digest of its recipe (one
``all_gather_object``): a site started twice under one name, or with a recipe that differs
from the first site's, is refused naming the sites and the first differing field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.setup_checks import check_trainer

#: The environment variable that names this process's site when ``silo`` is not given.
SILO_ENV = "LIGHTNING_FL_SILO"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class SiloSiteError(collectives.SiteFault, ValueError):
    """A site that cannot take part: no name, a name not in the recipe, a name taken by
    another site, a recipe that differs from the others', or a launcher that fixes ranks."""


class SiloSites:
    """The recipe's site names, in the clients' order, and this process's site: ``name``
    (None: the ``LIGHTNING_FL_SILO`` environment variable)."""

    def __init__(self, names: Sequence[str], name: str | None = None) -> None:
        names = tuple(names)
        bad = [n for n in names if not isinstance(n, str) or not _NAME.fullmatch(n)]
        if not names or bad:
            raise SiloSiteError(
                f"silos must be a non-empty list of site names (letters, digits, '_', '.', "
                f"'-'; they name folders), got {list(names)!r}."
            )
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SiloSiteError(f"silos names {', '.join(twice)} twice: give each site once.")
        self.names, self._name = names, name
        if name is not None and name not in names:
            raise SiloSiteError(
                f"silo={name!r} is not in the recipe's silos ({', '.join(names)}): name one "
                "of them, or add it to FederatedStrategy(silos=[...]) on every site."
            )

    @classmethod
    def named(
        cls, silos: bool | Sequence[str], name: str | None, transport: object = None
    ) -> SiloSites | None:
        """The sites of ``FederatedStrategy(silos=...)`` when it lists names, else None
        (refused with a ``transport``: its sites are known by name)."""
        if isinstance(silos, bool) and transport is not None:
            raise SiloSiteError(
                f"transport={type(transport).__name__}(...) joins sites known by name, but "
                f"silos={silos} names none: list every site's name, silos=[...], in the recipe."
            )
        if isinstance(silos, bool):
            if name is not None:
                raise SiloSiteError(
                    f"silo={name!r} names this site, but silos={silos} names none: list "
                    "every site's name, silos=[...], in the recipe."
                )
            return None
        return cls(silos, name)

    @property
    def name(self) -> str:
        """This process's site: the name it was given (checked against the recipe's), or,
        on one machine (one node: a simulation), the name at its launcher's rank."""
        if self._name is None:
            self._name = self._given()
            if self._name is None:
                raise SiloSiteError(
                    f"this site has no name: start it with --silo NAME (or {SILO_ENV}=NAME), "
                    f"NAME one of {', '.join(self.names)}."
                )
        return self._name

    def _given(self) -> str | None:
        name = os.environ.get(SILO_ENV) or None
        if name is not None and name not in self.names:
            raise SiloSiteError(
                f"site {name!r} is not in the recipe's silos ({', '.join(self.names)}): start "
                "it with one of them, or add it to FederatedStrategy(silos=[...]) on every site."
            )
        return name

    def assign_rank(self, environment: Any, world_size: int, num_nodes: int) -> int:
        """Give this process its site's rank (its name's place in the recipe), in
        Lightning's cluster environment (and in ``RANK``, which torchrun's environment
        reads) and in the rank-zero utilities. A process without a name on a one-node
        run (the sites simulated on one machine) is the site at its launcher's rank."""
        if world_size != len(self.names):
            raise SiloSiteError(
                f"the recipe names {len(self.names)} silos ({', '.join(self.names)}) but the "
                f"run has {world_size} processes: start one process per site "
                f"(--trainer.num_nodes {len(self.names)} --trainer.devices 1)."
            )
        if self._name is None and self._given() is None and num_nodes == 1:
            self._name = self.names[environment.global_rank()]
        rank = self.names.index(self.name)
        os.environ["RANK"] = str(rank)
        environment.set_global_rank(rank)
        if environment.global_rank() != rank:
            raise SiloSiteError(
                f"{type(environment).__name__} fixes each process's rank, which named silos "
                "set from the site's name: launch the sites with torchrun or one "
                "`lightning-fl fit --silo NAME` each."
            )
        rank_zero_only.rank = fabric_rank_zero_only.rank = rank
        return rank


def join_silos(trainer: pl.Trainer, config: Any, sites: SiloSites | None, ranks: Any) -> None:
    """This process joins the silo federation, before the datamodule's ``prepare_data``:
    the trainer checked, every site's name and recipe (the site names' list included)
    checked against the others' (:func:`check_peers`) and the datamodule told which silo
    it is (``sites``: the named sites, None when they are unnamed)."""
    check_trainer(trainer)
    site = sites.name if sites is not None else None
    if ranks.distributed:
        recipe = site_recipe(trainer, config, sites.names if sites is not None else None)
        check_peers(site or f"silo {ranks.rank}", recipe, ranks.world_size)
    trainer.datamodule.enter_silo(ranks.rank, ranks.world_size, site)


def site_recipe(trainer: pl.Trainer, config: Any, names: Sequence[str] | None) -> dict[str, str]:
    """What a site checks against the others' (:func:`recipe_digest`, with the list of the
    sites' ``names``, or None when they are unnamed)."""
    recipe = recipe_digest(trainer, config)
    recipe["strategy.silos"] = repr(list(names)) if names is not None else "True"
    return recipe


def check_peers(name: str, recipe: dict[str, str], world_size: int) -> None:
    """Refuse, on every site, a name taken twice or a recipe that differs from the first
    site's (naming the first differing field): one ``all_gather_object`` of this site's
    ``name`` and ``recipe`` (:func:`recipe_digest`)."""
    sites = collectives.across_ranks(world_size).all_gather_object((name, recipe))
    check_sites(sites)


def check_sites(sites: Sequence[tuple[str, dict[str, str]]]) -> None:
    """The check of :func:`check_peers` on the gathered (name, recipe) pairs, in rank
    order. The site at fault is the one whose recipe differs from most sites' (from the
    first site's, on a tie)."""
    names = [name for name, _ in sites]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SiloSiteError(
            f"{names.count(twice[0])} sites started as {twice[0]!r}: give each site its own "
            f"name (--silo NAME); the sites started as {', '.join(names)}."
        )
    odd = collectives.odd_site([(name, tuple(sorted(recipe.items()))) for name, recipe in sites])
    if odd is None:
        return
    name, holder = odd
    recipe, common = dict(sites)[name], dict(sites)[holder]
    field = next(f for f in sorted(set(common) | set(recipe)) if common.get(f) != recipe.get(f))
    raise SiloSiteError(
        f"site {name!r}'s recipe differs from site {holder!r}'s in {field}: "
        f"{recipe.get(field, '(unset)')} there, {common.get(field, '(unset)')} at "
        f"{holder!r}. Start every site with the same recipe.",
        site=name,
    )


def recipe_digest(trainer: pl.Trainer, config: Any) -> dict[str, str]:
    """What every site must agree on, as printable values: the strategy's federated
    settings, the number of rounds, the module's class and hyper-parameters, the
    datamodule's class and batch size (not its paths: each site has its own), the
    callbacks' classes and the plugins' plain settings (numbers, strings, flags)."""
    digest = {f"strategy.{k}": _shown(v) for k, v in dataclasses.asdict(config).items()}
    digest["trainer.max_epochs"] = _shown(trainer.max_epochs)
    module, data = trainer.lightning_module, trainer.datamodule
    digest["model.class"] = type(module).__name__
    digest |= {f"model.{k}": _shown(v) for k, v in dict(getattr(module, "hparams", {})).items()}
    digest["data.class"] = type(data).__name__
    digest["data.batch_size"] = _shown(getattr(data, "batch_size", None))
    for i, cb in enumerate(c for c in trainer.callbacks if not isinstance(c, ProgressBar)):
        digest[f"callbacks[{i}]"] = type(cb).__name__
        if isinstance(cb, FederatedCallback):  # its settings (not another callback's paths)
            digest |= {f"callbacks[{i}].{k}": _shown(v) for k, v in vars(cb).items()
                       if not k.startswith("_") and isinstance(v, _SETTINGS)}  # fmt: skip
    return digest


_SETTINGS = (bool, int, float, str, type(None))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"
