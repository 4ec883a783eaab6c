"""Silo mode (issue 36): each rank a silo that opens only its own clients' data, shares
their sample counts once, and keeps their state in its own checkpoint shard.

The 4-silo Fed-Heart-Disease recipe runs as 4 gloo processes with an open-file audit
(tests/silo_audit.py): every rank opened its own center's file and no other, and the
model equals the 1-process simulation's."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import SCAFFOLD, FedAvg, Pooled
from lightning_fl.datamodules import DigitsDataModule, FedHeartDiseaseDataModule
from lightning_fl.datamodules.flamby import HEART_CENTERS, HEART_LEVELS, heart_disease_tables
from lightning_fl.engine import silo_checkpoints
from lightning_fl.engine.composition import CompositionError
from lightning_fl.engine.data_contract import SiloError
from lightning_fl.engine.federated_state import CheckpointReadError
from tests.helpers import make_trainer, max_abs_diff, params_of, tiny_datamodule, tiny_module
from tests.recipes_distributed import run_file

ROOT = Path(__file__).resolve().parents[1]
HEART = ROOT.parent / "shared" / "data" / "fed_heart_disease"
needs_heart = pytest.mark.skipif(not HEART.exists(), reason=f"real data not found at {HEART}")


def test_a_silo_opens_only_its_own_clients_and_says_whose_the_others_are():
    dm = DigitsDataModule(num_clients=6)
    dm.enter_silo(1, 4)
    assert dm.local_clients() == [1, 5]
    assert len(dm.client_dataset(5, "train")) > 0
    with pytest.raises(SiloError, match="client 2's data is held by silo 2, not by this one"):
        dm.client_dataset(2, "train")
    with pytest.raises(SiloError, match="pooled dataset"):
        dm.pooled_dataset()
    assert set(dm.local_sample_counts("train")) == {1, 5}


@needs_heart
def test_the_shared_heart_encoding_is_the_one_the_four_files_give(tmp_path):
    """A silo encodes its own file with HEART_LEVELS; FLamby's levels come from the four
    files: they agree, so silo and simulation see the same features. A silo reads only
    its own file: its folder holds nothing else."""
    computed = heart_disease_tables(HEART)
    shared = heart_disease_tables(HEART, levels=HEART_LEVELS)
    assert all((a["x"] == b["x"]).all() for a, b in zip(computed, shared))
    (tmp_path / "2").mkdir()
    shutil.copy(HEART / "processed.switzerland.data", tmp_path / "2")
    dm = FedHeartDiseaseDataModule(root=str(tmp_path / "{rank}"))
    dm.enter_silo(2, 4)
    dm.setup("fit")
    whole = FedHeartDiseaseDataModule(root=str(HEART))
    for split in ("train", "test"):
        assert torch.equal(dm.client_dataset(2, split).tensors[0],
                           whole.client_dataset(2, split).tensors[0])  # fmt: skip
    with pytest.raises(ValueError, match=r"per silo: run it with FederatedStrategy\(silos=True\)"):
        FedHeartDiseaseDataModule(root=str(tmp_path / "{rank}")).setup("fit")
    named = FedHeartDiseaseDataModule(root=str(tmp_path / "{silo}"))
    with pytest.raises(ValueError, match=r"run it with FederatedStrategy\(silos=\[...names\]\)"):
        named.setup("fit")
    named.enter_silo(1, 4)  # silo mode, but the sites have no names
    with pytest.raises(ValueError, match=r"silos=\[...names\]"):
        named.setup("fit")
    named.enter_silo(1, 4, "hungarian")
    assert named.silo_folder(named.root) == tmp_path / "hungarian"
    assert named.silo_folder("d/{rank}/{silo}") == Path("d/1/hungarian")


def test_silo_mode_refuses_the_pooled_baseline_and_streams_naming_both():
    """Both rules of silo mode's row of the refusal table (the pair matrix runs without
    silo mode)."""
    from lightning_fl.datamodules import StreamingDataModule

    trainer = make_trainer(FederatedStrategy(silos=True, local_steps=1), 1, [Pooled()])
    with pytest.raises(CompositionError, match=r"silos=True\) cannot be combined with Pooled"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    streams = StreamingDataModule(tiny_datamodule(), rate=3, capacity=6, rounds=2)
    trainer = make_trainer(FederatedStrategy(silos=True, local_steps=1), 1)
    with pytest.raises(CompositionError, match="cannot be combined with StreamingDataModule"):
        trainer.fit(tiny_module(), datamodule=streams)


def _silo_fit(rounds: int, dirpath: Path, ckpt_path: str | None = None):
    strategy = FederatedStrategy(silos=True, local_steps=2, seed=3)
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0)
    trainer = make_trainer(strategy, rounds, [SCAFFOLD(), FedAvg(), checkpoint],
                           enable_checkpointing=True)  # fmt: skip
    module = tiny_module()
    trainer.fit(module, datamodule=tiny_datamodule(), ckpt_path=ckpt_path, weights_only=True)
    return module


def test_a_silo_checkpoint_keeps_client_state_in_its_shard_and_resumes_exactly(tmp_path):
    """SCAFFOLD's control variates c_i (client state) go to the silo's shard, not to the
    global file; resuming round 3 of 4 from them equals the run that never stopped; a
    missing shard, another number of silos and a resume outside silo mode are refused
    naming the file."""
    straight = _silo_fit(4, tmp_path / "straight")
    _silo_fit(3, tmp_path / "first")
    last = tmp_path / "first" / "last.ckpt"
    shard = Path(silo_checkpoints.shard_path(last, 0, 1))
    saved = torch.load(last, weights_only=True)["callbacks"]["_RoundDriver"]
    assert saved["client_store"] == {} and saved["silos"] == 1
    assert sorted(torch.load(shard, weights_only=True)["client_store"]) == list(range(10))
    resumed = _silo_fit(4, tmp_path / "resumed", ckpt_path=str(last))
    assert max_abs_diff(params_of(straight), params_of(resumed)) == 0.0
    checkpoint = torch.load(last, weights_only=True)
    with pytest.raises(silo_checkpoints.SiloCheckpointError, match="made by 1 silos, resumed by 2"):
        silo_checkpoints.merge_shard(checkpoint, last, 0, 2)
    with pytest.raises(silo_checkpoints.SiloCheckpointError, match="silos=True"):
        silo_checkpoints.check_not_sharded(checkpoint, last)
    torch.save({"client_store": {0: {"x": _NotData()}}, "rank": 0, "world_size": 1}, shard)
    with pytest.raises(CheckpointReadError, match=f"{shard.name}: cannot be read as a checkpoint"):
        silo_checkpoints.merge_shard(checkpoint, last, 0, 1)  # weights_only: no object loaded
    shard.unlink()
    with pytest.raises(silo_checkpoints.SiloCheckpointError, match=f"{shard.name} is missing"):
        silo_checkpoints.merge_shard(checkpoint, last, 0, 1)


def test_a_shard_of_another_silo_run_or_round_is_refused_naming_both(tmp_path):
    """The issue's ``cp last.ckpt.silo2-of-4 last.ckpt.silo1-of-4``: silo 1 refuses silo
    2's shard (and a shard whose rank field was edited but whose clients are silo 2's);
    a shard of another run or of another round than the checkpoint beside it is refused;
    a silo's own shard of the same run and round loads. The run's id is drawn at its
    first fit, kept by its checkpoints and recorded in every shard."""
    _silo_fit(2, tmp_path / "first")
    last = tmp_path / "first" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["callbacks"]["_RoundDriver"]
    shard = torch.load(silo_checkpoints.shard_path(last, 0, 1), weights_only=True)
    assert len(saved["run_id"]) == 32 and shard["run_id"] == saved["run_id"]
    assert shard["round"] == saved["round"] == 2
    assert shard["clients"] == list(range(10)) and (shard["rank"], shard["world_size"]) == (0, 1)

    global_file = tmp_path / "global.ckpt"
    state = {"client_store": {}, "silos": 4, "round": 7, "run_id": "run-a"}
    torch.save({"callbacks": {"_RoundDriver": state}}, global_file)

    def write(rank_field, clients, run="run-a", round_=7, as_rank=1):
        data = {"client_store": {c: {"scaffold_c": torch.ones(2) * c} for c in clients},
                "rank": rank_field, "world_size": 4, "clients": clients, "run_id": run,
                "round": round_}  # fmt: skip
        torch.save(data, silo_checkpoints.shard_path(global_file, as_rank, 4))

    def merge():
        checkpoint = torch.load(global_file, weights_only=True)
        return silo_checkpoints.merge_shard(checkpoint, global_file, 1, 4)

    write(2, [2, 6])  # silo 2's shard copied over silo 1's
    with pytest.raises(silo_checkpoints.SiloCheckpointError,
                       match=r"silo1-of-4 holds the state of silo 2 of 4, not of this silo "
                             r"\(1 of 4\)"):  # fmt: skip
        merge()
    write(1, [2, 6])  # its rank edited, its clients still silo 2's
    with pytest.raises(silo_checkpoints.SiloCheckpointError, match=r"clients \[2, 6\] of other"):
        merge()
    write(1, [1, 5], run="run-b")
    with pytest.raises(silo_checkpoints.SiloCheckpointError,
                       match="is of run run-b, the checkpoint beside it of run run-a"):  # fmt: skip
        merge()
    write(1, [1, 5], round_=6)
    with pytest.raises(silo_checkpoints.SiloCheckpointError,
                       match="is of round 6, the checkpoint beside it of round 7"):  # fmt: skip
        merge()
    write(1, [1, 5])
    merged = merge()["callbacks"]["_RoundDriver"]["client_store"]
    assert sorted(merged) == [1, 5] and torch.equal(merged[5]["scaffold_c"], torch.ones(2) * 5)


class _NotData:
    """An object a shard must never load (weights_only refuses it)."""


@pytest.fixture(scope="module")
def heart_simulation(tmp_path_factory) -> dict[str, torch.Tensor]:
    """heart_silos.yaml on one process over the four centers' files, 3 rounds: the model
    its silo runs must equal (run once for this module's tests)."""
    one = tmp_path_factory.mktemp("heart_one_process")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_fl.cli", "fit", "--config",
         str(ROOT / "recipes" / "flamby" / "heart_silos.yaml"), "--trainer.max_epochs", "3",
         "--trainer.devices", "1", "--data.init_args.root", str(HEART),
         "--trainer.strategy.init_args.silos", "false", "--test_after_fit", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(one),
         "--trainer.logger.init_args.save_dir", str(one)],
        cwd=one, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(run_file(one, "last.ckpt"), weights_only=True)["state_dict"]


@needs_heart
def test_four_silos_open_only_their_own_file_and_equal_one_process(tmp_path, heart_simulation):
    """The recipe on 4 gloo processes, the four files in one folder: the audit shows each
    rank opened exactly its own center's file; each shard holds its own client's SCAFFOLD
    state and the global file none; the model equals the 1-process simulation's."""
    from tests.test_flamby import _recipe_settings

    recipes = ROOT / "recipes" / "flamby"
    assert _recipe_settings(recipes / "heart_silos.yaml") == _recipe_settings(
        recipes / "heart_scaffold.yaml"
    )  # FLamby's SCAFFOLD setup, on 4 silos
    data, out = tmp_path / "data", tmp_path / "audit"
    data.mkdir()
    out.mkdir()
    for name in HEART_CENTERS:
        shutil.copy(HEART / f"processed.{name}.data", data)
    recipe = str(ROOT / "recipes" / "flamby" / "heart_silos.yaml")
    common = ["--config", recipe, "--trainer.max_epochs", "3", "--data.init_args.root", str(data),
              "--trainer.enable_progress_bar", "false", "--test_after_fit", "false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    silos = tmp_path / "silos"
    result = subprocess.run(
        [sys.executable, "-m", "tests.silo_audit", str(data), str(out), "--", "fit", *common,
         "--trainer.default_root_dir", str(silos), "--trainer.logger.init_args.save_dir",
         str(silos)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for rank, name in enumerate(HEART_CENTERS):
        opened = json.loads((out / f"opened_rank{rank}.json").read_text())
        assert opened == [str((data / f"processed.{name}.data").resolve())], (rank, opened)
    (last,) = [p for p in silos.glob("**/last.ckpt") if p.parent.name == "checkpoints"]
    assert torch.load(last, weights_only=True)["callbacks"]["_RoundDriver"]["client_store"] == {}
    for rank, name in enumerate(HEART_CENTERS):  # one machine: process r is the r-th site
        shard = torch.load(last.parent / name / "last.ckpt", weights_only=True)
        assert list(shard["client_store"]) == [rank] and shard["site"] == name
    a = torch.load(last, weights_only=True)["state_dict"]
    b = heart_simulation
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def _torchrun(config: dict, folder: Path, restarts: int) -> subprocess.CompletedProcess:
    """The config on 2 silos through torchrun, resuming from its last checkpoint if any."""
    import yaml

    folder.mkdir(parents=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), "-m", "lightning_fl.cli", "fit", "--config", str(path),
         "--ckpt_path", "last", "--trainer.devices", "2", "--trainer.enable_progress_bar",
         "false", "--test_after_fit", "false", "--trainer.default_root_dir", str(folder),
         "--trainer.logger.init_args.save_dir", str(folder)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_silo_killed_mid_round_restarts_and_the_run_ends_bit_identical(tmp_path):
    """SCAFFOLD on 2 silos for 4 rounds, a checkpoint every round: rank 1 is killed by
    SIGKILL in the middle of round 2; torchrun (--max-restarts 1) restarts both, they
    resume from the last checkpoint (round 1's: the global file and each silo's shard) and
    the run ends bit-identical to one that was never interrupted."""
    import yaml

    config = yaml.safe_load((ROOT / "recipes" / "scaffold.yaml").read_text())
    config["trainer"]["max_epochs"] = 4
    config["trainer"]["strategy"]["init_args"].update(local_steps=4, silos=True)
    config["trainer"]["limit_val_batches"] = 0
    callbacks = config["trainer"]["callbacks"]

    def run(name: str, kill: bool, restarts: int) -> Path:
        folder = tmp_path / name
        checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                      "init_args": {"dirpath": str(folder / "checkpoints"), "save_last": True,
                                    "every_n_epochs": 1}}  # fmt: skip
        killer = {"class_path": "tests.restart_kill.KillOnce",
                  "init_args": {"marker": str(tmp_path / "killed")}}  # fmt: skip
        config["trainer"]["callbacks"] = [*callbacks[:2], checkpoint, *([killer] if kill else [])]
        result = _torchrun(config, folder, restarts)
        assert result.returncode == 0, result.stderr[-3000:]
        return folder / "checkpoints" / "last.ckpt"

    straight = run("straight", kill=False, restarts=0)
    restarted = run("restarted", kill=True, restarts=1)
    assert (tmp_path / "killed").read_text().startswith("killed rank 1 in round 2")
    # the second attempt resumed (round 1's checkpoint): its log starts at round 2
    import csv

    logs = sorted((tmp_path / "restarted").glob("**/version_*/metrics.csv"))
    assert len(logs) == 2
    with open(logs[1]) as handle:
        rounds = {int(row["epoch"]) for row in csv.DictReader(handle) if row.get("epoch")}
    assert min(rounds) == 2 and max(rounds) == 3
    a, b = torch.load(straight, weights_only=True), torch.load(restarted, weights_only=True)
    assert a["epoch"] == b["epoch"] == 3
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    for rank in range(2):
        shards = [torch.load(silo_checkpoints.shard_path(p, rank, 2), weights_only=True)
                  for p in (straight, restarted)]  # fmt: skip
        assert sorted(shards[0]["client_store"]) == sorted(shards[1]["client_store"])
        for client, entry in shards[0]["client_store"].items():
            for key, value in entry.items():
                other = shards[1]["client_store"][client][key]
                assert all(torch.equal(x, y) for x, y in zip(value, other)), (client, key)


def test_a_natural_split_silo_reads_only_its_own_center_files(tmp_path):
    """Centers a, b, c on 2 silos: silo 1 holds b only (its folder has nothing else) and
    gets the same tensors as a simulation reading the three files; it refuses a's data,
    and silo mode without the centers' list or with one table is refused with the fix."""
    from lightning_fl.datamodules import NaturalSplitDataModule

    def table(path: Path, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = ["f1,f2,label"] + [
            f"{float(a):.4f},{float(b):.4f},{i % 2}"
            for i, (a, b) in enumerate(torch.randn(20, 2, generator=g))
        ]
        path.write_text("\n".join(rows) + "\n")

    every, own = tmp_path / "every", tmp_path / "silo1"
    every.mkdir()
    own.mkdir()
    for seed, name in enumerate("abc"):
        table(every / f"{name}.csv", seed)
    shutil.copy(every / "b.csv", own)
    whole = NaturalSplitDataModule(str(every), ["label"], centers=["a", "b", "c"])
    silo = NaturalSplitDataModule(str(tmp_path / "silo{rank}"), ["label"], centers=["a", "b", "c"])
    silo.enter_silo(1, 2)
    assert silo.num_clients == 3 and silo.local_clients() == [1]
    for split in ("train", "test"):
        pairs = zip(silo.client_dataset(1, split).tensors, whole.client_dataset(1, split).tensors)
        assert all(torch.equal(s, w) for s, w in pairs)
    with pytest.raises(SiloError, match="client 0's data is held by silo 0"):
        silo.client_dataset(0, "train")
    bare = NaturalSplitDataModule(str(own), ["label"])
    bare.enter_silo(1, 2)
    with pytest.raises(ValueError, match=r"needs centers=\[\.\.\.\]"):
        bare.setup("fit")
    one_table = NaturalSplitDataModule(str(every / "a.csv"), ["label"], centers=["a"])
    one_table.enter_silo(0, 1)
    with pytest.raises(ValueError, match="not one table of every center"):
        one_table.setup("fit")


def _start_sites(order, recipe, cwd, out, extra, port) -> dict[str, subprocess.Popen]:
    """One ``lightning-fl fit --silo NAME`` process per site, started in ``order`` on
    localhost (the first site of the recipe hosts the rendezvous store), each under the
    open-file audit of tests/silo_audit.py."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    env.pop("LIGHTNING_FL_SILO", None)
    return {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.silo_audit",
                str(cwd),
                str(out),
                "--",
                "fit",
                "--config",
                str(recipe),
                "--silo",
                name,
                "--trainer.num_nodes",
                str(len(order)),
                "--trainer.devices",
                "1",
                "--trainer.enable_progress_bar",
                "false",
                "--test_after_fit",
                "false",
                "--trainer.strategy.init_args.timeout",
                "120",
                "--trainer.default_root_dir",
                "run",
                "--trainer.logger.init_args.save_dir",
                "run",
                *extra,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in order
    }


def _finish(sites: dict[str, subprocess.Popen]) -> dict[str, tuple[int, str]]:
    return {name: (p.wait(timeout=600), p.stderr.read()) for name, p in sites.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_heart
def test_named_sites_started_in_any_order_hold_their_own_centers_and_resume(
    tmp_path, heart_simulation
):
    """The shipped recipe as written, its 4 sites started by name in reverse order (the
    issue: a launcher's ranks follow host names and pids, not the recipe): each site
    opens only its own center's file, in its own folder (``data/heart_silos/{silo}``),
    and writes its shard in its own folder. Killed after 2 rounds and restarted in
    another order with ``--ckpt_path last``, every site reads only its own shard (no
    site but the first opens the global checkpoint), the run continues in its folder,
    and round 3's model equals the 1-process simulation's of 3 rounds."""
    from tests.test_flamby import _recipe_settings  # noqa: F401 - FLamby's settings, above

    recipe = ROOT / "recipes" / "flamby" / "heart_silos.yaml"
    sites = tmp_path / "sites"  # the working folder of the 4 sites, audited
    for name in HEART_CENTERS:
        folder = sites / "data" / "heart_silos" / name
        folder.mkdir(parents=True)
        shutil.copy(HEART / f"processed.{name}.data", folder)
    out = tmp_path / "audit"
    out.mkdir()
    first = _finish(_start_sites(HEART_CENTERS[::-1], recipe, sites, out,
                                 ["--trainer.max_epochs", "2"], _free_port()))  # fmt: skip
    assert all(code == 0 for code, _ in first.values()), {
        n: e[-2000:] for n, (_, e) in first.items()
    }
    checkpoints = sites / "run" / "heart_silos" / "version_0" / "checkpoints"
    for rank, name in enumerate(HEART_CENTERS):
        shard = torch.load(checkpoints / name / "last.ckpt", weights_only=True)
        assert (shard["site"], shard["rank"], list(shard["client_store"])) == (name, rank, [rank])
    opened_first = {rank: json.loads((out / f"opened_rank{rank}.json").read_text())
                    for rank in range(4)}  # fmt: skip
    again = ["hungarian", "va", "cleveland", "switzerland"]
    second = _finish(_start_sites(again, recipe, sites, out,
                                  ["--trainer.max_epochs", "3", "--ckpt_path", "last"],
                                  _free_port()))  # fmt: skip
    assert all(code == 0 for code, _ in second.values()), {
        n: e[-2000:] for n, (_, e) in second.items()
    }
    assert sorted(p.name for p in (sites / "run" / "heart_silos").iterdir()) == ["version_0"]
    with open(checkpoints.parent / "metrics.csv") as handle:
        rounds = {int(row["epoch"]) for row in csv.DictReader(handle) if row.get("epoch")}
    assert rounds == {0, 1, 2}
    for rank, name in enumerate(HEART_CENTERS):
        own_data = str((sites / "data" / "heart_silos" / name).resolve())
        own_shard = str((checkpoints / name).resolve())
        own_log = str((checkpoints.parent / "sites" / f"{name}.log").resolve())
        opened = json.loads((out / f"opened_rank{rank}.json").read_text())
        for path in {*opened, *opened_first[rank]}:
            others = [n for n in HEART_CENTERS if n != name]
            assert not any(f"/heart_silos/{n}/" in path or f"/checkpoints/{n}/" in path
                           or f"/sites/{n}.log" in path for n in others), (name, path)  # fmt: skip
            if rank > 0:  # no folder shared with another site
                assert path.startswith((own_data, own_shard, own_log)), (name, path)
        assert f"{own_shard}/last.ckpt" in opened  # resumed from its own shard
    _check_site_logs(checkpoints.parent, HEART_CENTERS, run_id=a_run_id(checkpoints))
    a = torch.load(checkpoints / "last.ckpt", weights_only=True)["state_dict"]
    b = heart_simulation
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def a_run_id(checkpoints: Path) -> str:
    return torch.load(checkpoints / "last.ckpt", weights_only=True)["callbacks"][
        "_RoundDriver"]["run_id"]  # fmt: skip


def _check_site_logs(folder: Path, names: list[str], run_id: str) -> None:
    """Every site's own log (engine/site_log.py) in the run folder: the fresh fit of
    rounds 0-1, each round with the client it trained and the round's training loss
    (metrics.csv's, written by the first site alone), then the resumed fit of round 2."""
    with open(folder / "metrics.csv") as handle:
        losses = {int(row["epoch"]): float(row["train_loss_epoch"])
                  for row in csv.DictReader(handle) if row.get("train_loss_epoch")}  # fmt: skip
    for rank, name in enumerate(names):
        lines = (folder / "sites" / f"{name}.log").read_text().splitlines()
        expected = [f"site {name!r}: run {run_id[:12]} starts: rounds 0-1 to train"]
        for r in (0, 1):
            expected.append(f"site {name!r}: round {r}/1: trained clients [{rank}] of 4 "
                            f"participants; train_loss {losses[r]:.4g}")  # fmt: skip
        expected.append(f"site {name!r}: run {run_id[:12]}, resumed from its checkpoint of "
                        "round 1: rounds 2-2 to train")  # fmt: skip
        expected.append(f"site {name!r}: round 2/2: trained clients [{rank}] of 4 "
                        f"participants; train_loss {losses[2]:.4g}")  # fmt: skip
        assert lines == expected, (name, lines)


def test_a_rejoining_site_takes_the_offered_global_part_with_its_own_store_or_is_refused(
    capsys,
):
    """Issue 76: the others offer the global part (a fifth value) in the resume agreement;
    the site that is back keeps its own client store under it. Its shard must be of the
    run, no later than the others' round, and readable; without an offer, no rejoin."""
    from lightning_fl.engine.silo_checkpoints import DRIVER_KEY, rejoined_checkpoint

    def global_part(round_idx, store):
        return {"state_dict": {"w": torch.tensor([float(round_idx)])},
                "callbacks": {DRIVER_KEY: {"round": round_idx, "client_store": store}}}  # fmt: skip

    own = global_part(0, {1: {"c": torch.ones(2)}})
    sites = [("usa", None, "run-a", 2, global_part(2, {})),
             ("hungary", None, "run-a", 0),
             ("switzerland", None, "run-a", 2, None)]  # fmt: skip
    rejoined = rejoined_checkpoint(own, sites, "hungary")
    assert capsys.readouterr().out == (
        "site 'hungary' rejoins the run after round 2 (its own checkpoint is of round 0); "
        "the global part comes from site 'usa'.\n"
    )
    assert rejoined["state_dict"]["w"].tolist() == [2.0]
    assert torch.equal(rejoined["callbacks"][DRIVER_KEY]["client_store"][1]["c"], torch.ones(2))
    together = [("usa", None, "run-a", 2), ("hungary", None, "run-a", 2)]
    assert rejoined_checkpoint(own, together, "hungary") is None
    for entry, message in [
        (("hungary", None, "run-b", 0), "rejoins with a checkpoint of run run-b, the others run"),
        (("hungary", None, "run-a", 3), "checkpoint of round 3, after the others' round 2"),
        (("hungary", "shard missing", None, None), "cannot rejoin the run: shard missing"),
    ]:
        with pytest.raises(silo_checkpoints.SiloCheckpointError, match=message):
            rejoined_checkpoint(own, [sites[0], entry, sites[2]], "hungary")
    # the last round's own checkpoint (round 2, the others' round) is welcome
    assert rejoined_checkpoint(own, [sites[0], ("hungary", None, "run-a", 2), sites[2]],
                               "hungary") is not None  # fmt: skip


def test_what_the_others_keep_for_a_site_that_comes_back_holds_no_client_store():
    """At a round's end while a site is missing, a site keeps the round's checkpoint to
    hand a site that comes back: its own clients' store is taken out (it never leaves
    the site), the number of silos recorded, everything else as Lightning dumped it."""
    from types import SimpleNamespace

    from lightning_fl.engine.context import Ranks
    from lightning_fl.engine.rejoin import Welcome
    from lightning_fl.engine.silo_checkpoints import DRIVER_KEY

    dumped = {"state_dict": {"w": torch.ones(2)},
              "callbacks": {DRIVER_KEY: {"round": 4, "client_store": {2: {"c": torch.ones(1)}},
                                         "run_id": "run-a"}}}  # fmt: skip
    connector = SimpleNamespace(dump_checkpoint=lambda weights_only: dumped)
    trainer = SimpleNamespace(_checkpoint_connector=connector)
    welcome = Welcome.at_round_end(trainer, SimpleNamespace(ranks=Ranks(3, 2)), "run-a")
    state = welcome.checkpoint["callbacks"][DRIVER_KEY]
    assert state == {"round": 4, "client_store": {}, "run_id": "run-a", "silos": 3}
    assert torch.equal(welcome.checkpoint["state_dict"]["w"], torch.ones(2))
    assert welcome.run_id == "run-a"
