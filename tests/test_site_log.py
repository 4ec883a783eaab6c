"""A site's own lines (engine/site_log.py): what each says, and where it goes. The lines of
a real run (fresh, then resumed, 4 sites) are checked in tests/test_silos.py, and over
Flower in tests/test_flower.py."""

from __future__ import annotations

import torch

from lightning_fl.engine.site_log import FinishedRound, SiteLog, trained_here


def test_a_sites_lines_go_to_its_console_and_its_file_in_order(tmp_path):
    said: list[str] = []
    path = tmp_path / "run" / "sites" / "bern.log"
    log = SiteLog("bern", str(path), last_round=9, echo=said.append)
    log.fit_started("0123456789abcdef", 0, resumed=False)
    log.flush({"train_loss": torch.tensor(0.5)})  # nothing held yet: nothing said
    log.round_ended(FinishedRound(0, (1, 4), participants=6, dropped=0))
    metrics = {"val_loss": 1.5, "train_loss": torch.tensor(0.123456),
               "val_acc": torch.tensor(0.75), "val_acc_uniform": 0.1, "train_loss_epoch": 9.0,
               "fl/round": 0.0}  # fmt: skip
    log.flush(metrics)
    log.flush(metrics)  # once per round
    log.round_ended(FinishedRound(1, (), participants=6, dropped=2))
    log.flush({})
    SiteLog("bern", str(path), 9, said.append).fit_started("0123456789abcdef", 5, resumed=True)
    SiteLog("bern", str(path), 9, said.append).fit_started(None, 9, resumed=True)
    SiteLog("bern", str(path), 9, said.append).fit_started(None, 10, resumed=True)
    expected = [
        "site 'bern': run 0123456789ab starts: rounds 0-9 to train",
        "site 'bern': round 0/9: trained clients [1, 4] of 6 participants; train_loss 0.1235, "
        "val_acc 0.75, val_loss 1.5",
        "site 'bern': round 1/9: trained clients [] of 6 participants (2 dropped updates)",
        "site 'bern': run 0123456789ab, resumed from its checkpoint of round 4: rounds 5-9 to "
        "train",
        "site 'bern': run, resumed from its checkpoint of round 8: rounds 9-9 to train",
        "site 'bern': run, resumed from its checkpoint of round 9: no round left to train",
    ]
    assert said == expected
    assert path.read_text().splitlines() == expected  # appended: a resumed fit continues it


def test_the_clients_a_rank_trained():
    assert trained_here([3, 1, 4, 1], [0, 1, 1, 0], 1) == (1, 4)
    assert trained_here([3, 1, 4, 1], [0, 1, 1, 0], 0) == (3, 1)
    assert trained_here([3, 1], None, 2) == (3, 1)  # one process trains every participant
