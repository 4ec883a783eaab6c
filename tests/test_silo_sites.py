"""Sites known by name (issue 67, engine/silo_sites.py): a site's rank is its name's place
in the recipe, whatever its launcher said; a name not in the recipe, a name taken twice, a
recipe that differs from the first site's, another site's shard and sites that resume
different rounds are each refused, naming both sides and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import SCAFFOLD
from lightning_fl.engine import silo_checkpoints
from lightning_fl.engine.silo_checkpoints import SiloCheckpointError, SiloShards, agree
from lightning_fl.engine.silo_sites import (
    SILO_ENV,
    SiloSiteError,
    SiloSites,
    check_sites,
    recipe_digest,
)
from tests.helpers import tiny_datamodule, tiny_module

ROOT = Path(__file__).resolve().parents[1]
SITES = ["st_gallen", "bern", "basel"]


@pytest.fixture(autouse=True)
def _no_site_in_the_environment(monkeypatch):
    monkeypatch.delenv(SILO_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")


def _environment(launcher_rank: int) -> LightningEnvironment:
    environment = LightningEnvironment()
    environment.set_global_rank(launcher_rank)
    return environment


def test_a_sites_rank_is_its_names_place_whatever_the_launcher_said(monkeypatch):
    """The launcher gave ranks 0, 1, 2 to basel, st_gallen, bern (torchrun sorts by host
    name and pid): each becomes its name's place in the recipe, 2, 0, 1, in Lightning's
    environment and in RANK (torchrun's environment reads it); a name from the
    environment variable counts as one given; on one machine without names (a
    simulation), the launcher's rank picks the name."""
    for launcher_rank, name, expected in ((0, "basel", 2), (1, "st_gallen", 0), (2, "bern", 1)):
        environment = _environment(launcher_rank)
        assert SiloSites(SITES, name).assign_rank(environment, 3, num_nodes=3) == expected
        assert environment.global_rank() == expected and os.environ["RANK"] == str(expected)
        assert rank_zero_only.rank == expected  # who writes the run's folder
    monkeypatch.setenv(SILO_ENV, "bern")
    sites = SiloSites(SITES)
    assert sites.assign_rank(_environment(0), 3, num_nodes=3) == 1 and sites.name == "bern"
    monkeypatch.delenv(SILO_ENV)
    simulated = SiloSites(SITES)
    assert simulated.assign_rank(_environment(2), 3, num_nodes=1) == 2
    assert simulated.name == "basel"


def test_sites_that_cannot_take_part_are_refused_naming_the_fix(monkeypatch):
    for bad in ("two words", "../bern", "", 3):
        with pytest.raises(SiloSiteError, match=r"non-empty list of site names"):
            SiloSites(["bern", bad])
    with pytest.raises(SiloSiteError, match=r"non-empty list of site names"):
        SiloSites([])
    with pytest.raises(SiloSiteError, match="names bern twice: give each site once"):
        SiloSites(["bern", "basel", "bern"])
    with pytest.raises(SiloSiteError, match=r"silo='zurich' is not in the recipe's silos"):
        SiloSites(SITES, "zurich")
    monkeypatch.setenv(SILO_ENV, "zurich")
    stranger = r"site 'zurich' is not in the recipe's silos \(st_gallen, bern, basel\): start"
    with pytest.raises(SiloSiteError, match=stranger):
        SiloSites(SITES).assign_rank(_environment(0), 3, num_nodes=3)
    monkeypatch.delenv(SILO_ENV)
    with pytest.raises(SiloSiteError, match=rf"no name: start it with --silo NAME \(or {SILO_ENV}"):
        SiloSites(SITES).assign_rank(_environment(0), 3, num_nodes=3)  # across machines
    with pytest.raises(SiloSiteError, match=r"names 3 silos .* but the run has 2 processes"):
        SiloSites(SITES, "bern").assign_rank(_environment(0), 2, num_nodes=2)
    fixed = SimpleNamespace(set_global_rank=lambda rank: None, global_rank=lambda: 0)
    with pytest.raises(SiloSiteError, match="fixes each process's rank"):
        SiloSites(SITES, "bern").assign_rank(fixed, 3, num_nodes=3)
    with pytest.raises(SiloSiteError, match=r"silo='bern' names this site, but silos=True"):
        FederatedStrategy(silos=True, silo="bern")
    named = FederatedStrategy(silos=SITES, silo="bern")
    assert named.config.silos is True and named.sites.names == tuple(SITES)
    assert named.sites.name == "bern" and FederatedStrategy(silos=True).sites is None


def test_a_name_taken_twice_or_a_differing_recipe_is_refused_naming_the_field():
    recipe = {"strategy.seed": "0", "model.lr": "0.1"}
    check_sites([("st_gallen", recipe), ("bern", dict(recipe)), ("basel", dict(recipe))])
    with pytest.raises(SiloSiteError, match=r"2 sites started as 'bern'.*started as "
                                            r"st_gallen, bern, bern"):  # fmt: skip
        check_sites([("st_gallen", recipe), ("bern", recipe), ("bern", recipe)])
    other = {**recipe, "model.lr": "0.5"}
    differs = r"site 'basel''s recipe differs from site 'st_gallen''s in model.lr: 0.5 there"
    with pytest.raises(SiloSiteError, match=differs):
        check_sites([("st_gallen", recipe), ("bern", recipe), ("basel", other)])
    two = {**recipe, "model.lr": "0.5", "strategy.seed": "1"}  # the first field, in order
    with pytest.raises(SiloSiteError, match=r"'st_gallen''s in model.lr"):
        check_sites([("st_gallen", recipe), ("bern", two)])
    missing = {"strategy.seed": "0"}
    with pytest.raises(SiloSiteError, match=r"in model.lr: \(unset\) there, 0.1"):
        check_sites([("st_gallen", recipe), ("bern", missing)])
    # the site at fault differs from most sites, the first one included (issue 77: the
    # Flower server names it, not the site that reported it); on a tie, the first's
    # recipe counts as the common one
    with pytest.raises(
        SiloSiteError,
        match=r"site 'st_gallen''s recipe differs from site "
        r"'bern''s in model.lr: 0.5 there, 0.1",
    ) as first:
        check_sites([("st_gallen", other), ("bern", recipe), ("basel", dict(recipe))])
    assert first.value.site == "st_gallen"
    with pytest.raises(SiloSiteError) as middle:
        check_sites([("st_gallen", recipe), ("bern", other), ("basel", recipe), ("uri", recipe)])
    assert middle.value.site == "bern"
    with pytest.raises(SiloSiteError) as tie:
        check_sites([("st_gallen", other), ("bern", recipe)])
    assert tie.value.site == "bern"


def test_the_recipe_digest_holds_what_sites_must_share_and_not_their_paths(tmp_path):
    """Two sites' trainers: the same recipe with another data root (each site its own
    folder) digests equal; another learning rate, round count, plugin setting or
    federated setting is the field that differs."""

    def digest(lr=0.1, rounds=3, option="uniform", seed=0, root="a"):
        strategy = FederatedStrategy(local_steps=2, seed=seed)
        datamodule = tiny_datamodule()
        datamodule.root = root  # a per-site path: not part of the digest
        module = tiny_module(lr=lr)
        module.hparams["classes"] = list(range(100))  # a long setting: shown in 200 chars
        trainer = SimpleNamespace(
            max_epochs=rounds, lightning_module=module, datamodule=datamodule,
            callbacks=[ModelCheckpoint(dirpath=root), SCAFFOLD(control_weighting=option)],
        )  # fmt: skip
        return recipe_digest(trainer, strategy.config)

    base = digest()
    assert digest(root="b") == base
    kinds = [base[k] for k in ("model.class", "data.class", "callbacks[0]", "callbacks[1]")]
    assert kinds == ["Classifier", "InMemoryFederatedDataModule", "ModelCheckpoint", "SCAFFOLD"]
    assert base["data.batch_size"] == "4" and not any(k.startswith("callbacks[0].") for k in base)
    assert base["model.classes"] == repr(list(range(100)))[:200] + "…"
    assert base["strategy.seed"] == "0" and base["trainer.max_epochs"] == "3"
    for changed, field in ((digest(lr=0.2), "model.lr"), (digest(rounds=4), "trainer.max_epochs"),
                           (digest(seed=1), "strategy.seed")):  # fmt: skip
        assert [k for k in base if base[k] != changed.get(k)] == [field]
    changed = digest(option="target")
    assert [k for k in base if base[k] != changed.get(k)] == ["callbacks[1].control_weighting"]


def _shard_of(site: str, rank: int, folder: Path, round_idx: int = 4, run: str = "run-a"):
    """What site ``site`` (rank ``rank`` of 3) writes at the end of round ``round_idx``."""
    store = {c: {"scaffold_c": torch.full((2,), float(c))} for c in range(rank, 9, 3)}
    state = {"client_store": store, "round": round_idx, "run_id": run}
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "callbacks": {"_RoundDriver": state}}
    SiloShards(True, rank, 3, site).save(checkpoint, folder / "last.ckpt")
    return checkpoint


def test_a_site_resumes_from_its_own_folder_and_refuses_another_sites_shard(tmp_path):
    """Each site's shard lies in its own folder and holds the global part: a site resumes
    from it alone (the global file is never read). The issue's swap (``cp`` of basel's
    shard over bern's) is refused naming both sites; so is a shard of a site that is not
    this one even when the ranks agree."""
    for rank, site in enumerate(SITES):
        _shard_of(site, rank, tmp_path)
    global_file = tmp_path / "last.ckpt"
    assert not global_file.exists()  # rank 0 writes it through Lightning; not needed here

    def unreadable(path):
        raise AssertionError(f"the global file was read: {path}")

    loaded = SiloShards(True, 1, 3, "bern").load(global_file, unreadable)
    store = loaded["callbacks"]["_RoundDriver"]["client_store"]
    assert sorted(store) == [1, 4, 7] and torch.equal(store[4]["scaffold_c"], torch.full((2,), 4.0))
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    bern = tmp_path / "bern" / "last.ckpt"
    bern.write_bytes((tmp_path / "basel" / "last.ckpt").read_bytes())
    with pytest.raises(SiloCheckpointError, match=r"bern/last.ckpt holds the state of site "
                                                  r"'basel', not of this site 'bern'"):  # fmt: skip
        SiloShards(True, 1, 3, "bern").load(global_file, unreadable)
    bern.unlink()
    with pytest.raises(SiloCheckpointError, match=r"site 'bern' cannot resume, so no site does: "
                                                  r".*bern/last.ckpt is missing"):  # fmt: skip
        SiloShards(True, 1, 3, "bern").load(global_file, unreadable)


def test_sites_that_resume_different_rounds_or_runs_or_one_that_cannot_are_all_refused():
    """What every site receives from the others at resume (name, problem, run, round):
    all agree; one site's shard of round 3 among rounds 4, another run, or a site that
    cannot resume (its problem named) stops every site, naming both."""
    agree([("st_gallen", None, "r", 4), ("bern", None, "r", 4), ("basel", None, "r", 4)], "bern")
    with pytest.raises(SiloCheckpointError, match=r"site 'basel''s checkpoint is of round 3, "
                                                  r"site 'st_gallen''s of round 4"):  # fmt: skip
        agree([("st_gallen", None, "r", 4), ("bern", None, "r", 4), ("basel", None, "r", 3)],
              "bern")  # fmt: skip
    with pytest.raises(SiloCheckpointError, match=r"site 'bern''s checkpoint is of run q, "):
        agree([("st_gallen", None, "r", 4), ("bern", None, "q", 4)], "st_gallen")
    sites = [("st_gallen", None, "r", 4), ("bern", "x is missing", None, None),
             ("basel", "y is unreadable", None, None)]  # fmt: skip
    with pytest.raises(SiloCheckpointError, match=r"site 'bern' \(and basel\) cannot resume, so "
                                                  r"no site does: x is missing"):  # fmt: skip
        agree(sites, "st_gallen")
    with pytest.raises(
        SiloCheckpointError, match=r"site 'basel' \(and bern\) .*y is unreadable"
    ) as own:
        agree(sites, "basel")  # a failing site names its own problem
    assert own.value.site == "bern"  # and every site the same one at fault
    # the first site's shard of an older round, among two of round 4: it is at fault
    older = r"site 'st_gallen''s checkpoint is of round 2, site 'bern''s of round 4"
    with pytest.raises(SiloCheckpointError, match=older) as first:
        agree([("st_gallen", None, "r", 2), ("bern", None, "r", 4), ("basel", None, "r", 4)],
              "basel")  # fmt: skip
    assert first.value.site == "st_gallen"


def test_a_shard_written_before_shards_held_the_global_part_is_merged_with_it(tmp_path):
    """Older shards (client store and identity only) are read with the global file
    beside them, as before."""
    global_file = tmp_path / "last.ckpt"
    state = {"client_store": {}, "silos": 2, "round": 1, "run_id": "r"}
    torch.save({"callbacks": {"_RoundDriver": state}}, global_file)
    shard = {"client_store": {1: {"x": torch.ones(1)}}, "rank": 1, "world_size": 2,
             "clients": [1], "run_id": "r", "round": 1}  # fmt: skip
    torch.save(shard, silo_checkpoints.shard_path(global_file, 1, 2))
    read = []
    loaded = SiloShards(True, 1, 2).load(
        global_file, lambda p: read.append(p) or torch.load(p, weights_only=True)
    )
    assert read == [global_file]
    assert list(loaded["callbacks"]["_RoundDriver"]["client_store"]) == [1]


def _site(name: str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_fl.cli", "fit", "--config",
         str(ROOT / "recipes" / "scaffold.yaml"), "--silo", name,
         "--trainer.strategy.init_args.silos", "[st_gallen, bern]", "--trainer.num_nodes",
         "2", "--trainer.devices", "1", "--trainer.max_epochs", "1",
         "--trainer.strategy.init_args.timeout", "60", "--trainer.logger", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
         "--trainer.enable_progress_bar", "false", "--test_after_fit", "false", *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_sites_with_different_recipes_both_stop_naming_the_field_and_a_stranger_at_once():
    """On localhost: bern started with another learning rate than st_gallen's: both stop at
    set-up, before any round, with one line naming model.lr; a site whose name is not in
    the recipe stops at once, naming the recipe's sites."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sites = [_site("st_gallen", port), _site("bern", port, "--model.init_args.lr", "0.5")]
    errors = [(p.wait(timeout=300), p.stderr.read()) for p in sites]
    for code, stderr in errors:
        last = stderr.strip().splitlines()[-1]
        assert code != 0 and "recipe differs from site 'st_gallen''s in model.lr" in last, last
    stranger = _site("zurich", port)
    code, stderr = stranger.wait(timeout=300), stranger.stderr.read()
    last = stderr.strip().splitlines()[-1]
    assert code != 0 and "site 'zurich' is not in the recipe's silos (st_gallen, bern)" in last


def test_a_site_that_dies_mid_round_stops_the_other_at_once_and_both_resume(tmp_path):
    """bern is killed (SIGKILL) in round 1 (both sites run the killing callback: the sites'
    recipes must agree, callbacks included): st_gallen does not wait for the collective's
    timeout (60 s here) but stops within seconds with one line naming itself and the fix;
    both sites restarted with --ckpt_path last resume at round 1 and finish the run."""
    import socket
    import time

    def start(name: str, port: int, *extra: str) -> subprocess.Popen:
        logger = ("{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: "
                  f"{tmp_path}}}}}")  # fmt: skip
        checkpoint = ("[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
                      "{save_last: true, every_n_epochs: 1}}]")  # fmt: skip
        return _site(name, port, "--trainer.max_epochs", "3", "--trainer.logger", logger,
                     "--trainer.enable_checkpointing", "true", "--trainer.default_root_dir",
                     str(tmp_path), "--trainer.callbacks", checkpoint, *extra)  # fmt: skip

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    marker = tmp_path / "killed"
    first = port()
    killer = ["--trainer.callbacks+=tests.restart_kill.KillOnce",
              f"--trainer.callbacks.marker={marker}", "--trainer.callbacks.round=1"]  # fmt: skip
    began = time.monotonic()
    sites = [start(name, first, *killer) for name in ("st_gallen", "bern")]  # kills bern
    codes = [p.wait(timeout=300) for p in sites]
    elapsed = time.monotonic() - began
    survivor = sites[0].stderr.read().strip().splitlines()[-1]
    assert marker.read_text().startswith("killed rank 1 in round 1")
    assert codes[0] == 1 and codes[1] == -9 and elapsed < 55, (codes, elapsed)
    assert survivor == (
        "lightning-fl: site 'st_gallen' (rank 0) stopped because another process failed; that "
        "process's error names the problem. Resume every site with --ckpt_path last."
    )
    second = port()
    sites = [start(name, second, "--ckpt_path", "last") for name in ("bern", "st_gallen")]
    assert [p.wait(timeout=300) for p in sites] == [0, 0], sites[1].stderr.read()[-2000:]
    import csv

    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    with open(metrics) as handle:
        rounds = {int(row["epoch"]) for row in csv.DictReader(handle) if row.get("epoch")}
    assert rounds == {0, 1, 2}


def test_joining_sends_the_sites_list_with_the_recipe_and_enters_the_named_silo(monkeypatch):
    """Two sites whose lists name the others differently (bern's ``[zurich, bern]``
    against st_gallen's ``[st_gallen, bern]``) get distinct ranks, so only the recipes'
    ``strategy.silos`` can tell them apart: it is sent with the digest, and the datamodule
    learns the site's name and rank."""
    from lightning_fl.engine import silo_sites

    sent = []
    monkeypatch.setattr(
        silo_sites, "check_peers", lambda name, recipe, world: sent.append((name, recipe))
    )
    for names, site in ((["st_gallen", "bern"], "st_gallen"), (["zurich", "bern"], "bern")):
        datamodule = tiny_datamodule()
        trainer = SimpleNamespace(
            accumulate_grad_batches=1, datamodule=datamodule, max_epochs=2,
            lightning_module=tiny_module(), callbacks=[],
        )  # fmt: skip
        sites = SiloSites(names, site)
        ranks = SimpleNamespace(distributed=True, rank=names.index(site), world_size=2)
        silo_sites.join_silos(trainer, FederatedStrategy(silos=names).config, sites, ranks)
        assert datamodule.silo == (ranks.rank, 2) and datamodule.silo_name == site
    (first, mine), (second, theirs) = sent
    assert (first, second) == ("st_gallen", "bern")
    assert mine["strategy.silos"] == "['st_gallen', 'bern']"
    with pytest.raises(SiloSiteError, match=r"in strategy.silos: \['zurich', 'bern'\] there"):
        check_sites(sent)
