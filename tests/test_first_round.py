"""``FederatedStrategy(first_round=t)``: a fit whose first epoch trains round t of a longer
run (the server-side mode's one-round fits, lightning_fl.flower.server_side)."""

from __future__ import annotations

import pytest

from lightning_fl import FederatedStrategy
from lightning_fl.systems.samplers import UniformSampler
from tests.helpers import make_trainer, max_abs_diff, params_of, tiny_datamodule, tiny_module


def _fit(rounds: int, first_round: int = 0, start=None):
    module = tiny_module()
    if start is not None:
        module.load_state_dict(start)
    strategy = FederatedStrategy(local_steps=3, seed=4, sampler=UniformSampler(2),
                                 first_round=first_round)  # fmt: skip
    make_trainer(strategy, rounds).fit(module, datamodule=tiny_datamodule(num_clients=5))
    return module


def test_a_fit_from_round_t_trains_round_t_of_the_longer_run():
    """Rounds 0-2 in one fit equal rounds 0-1, then a one-round fit with first_round=2
    from that model: the same participants (the sampler's draw of round 2), batches and
    seeds. From round 1 instead, the draw and the batches differ."""
    whole = params_of(_fit(3))
    two = _fit(2)
    third = _fit(1, first_round=2, start=two.state_dict())
    assert max_abs_diff(params_of(third), whole) <= 1e-6
    other = _fit(1, first_round=1, start=two.state_dict())
    assert max_abs_diff(params_of(other), whole) > 1e-4


@pytest.mark.parametrize("bad", [-1, True])
def test_a_negative_first_round_is_refused(bad):
    with pytest.raises(ValueError, match="first_round must be an integer >= 0"):
        FederatedStrategy(first_round=bad)
