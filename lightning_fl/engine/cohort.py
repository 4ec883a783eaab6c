"""Evaluation on a seeded cohort of clients, and the cohort estimate's standard error.

At 10⁵–10⁶ clients a validation pass over every client costs more than the rounds it
checks. As TFF and pfl-research do, each validation round evaluates a cohort of
``eval_clients`` clients drawn uniformly without replacement from the clients that have
data for the split, a function of (seed, round) alone (:func:`draw_cohort`: O(cohort)
work, whatever the population). The cohort's weighted, uniform and bottom-decile values
estimate the population's; the standard errors of the two means are logged beside them
(:func:`cohort_standard_errors`). ``trainer.validate`` and ``trainer.test`` evaluate every
client.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_fl.engine.seeding import derive_seed


def draw_cohort(eligible: np.ndarray, size: int, seed: int, round_idx: int) -> np.ndarray:
    """The sorted ids of ``size`` clients drawn uniformly without replacement from
    ``eligible`` (every one of them when there are no more), from (seed, "eval_cohort",
    round). NumPy's ``Generator.choice`` without replacement costs O(size) here.

    >>> draw_cohort(np.arange(10), 3, seed=0, round_idx=0).tolist()
    [0, 2, 3]
    >>> draw_cohort(np.array([2, 5]), 3, seed=0, round_idx=0).tolist()
    [2, 5]
    """
    if size >= len(eligible):
        return np.asarray(eligible)
    rng = np.random.default_rng(derive_seed(seed, "eval_cohort", round_idx))
    return np.sort(eligible[rng.choice(len(eligible), size, replace=False)])


def fit_cohort(
    federation: Any, split: str, config: Any, round_idx: int, fitting: bool
) -> tuple[np.ndarray | None, int | None]:
    """The cohort an evaluation epoch of ``split`` evaluates and the population it is
    drawn from: during a fit with ``config.eval_clients`` set, :func:`draw_cohort` over
    ``federation``'s clients with data for ``split``; otherwise (None, None), every client."""
    if config.eval_clients is None or not fitting:
        return None, None
    eligible = federation.clients_with_data(split)
    return draw_cohort(eligible, config.eval_clients, config.seed, round_idx), len(eligible)


def cohort_standard_errors(
    means: Sequence[float], counts: Sequence[float], population: int
) -> dict[str, float]:
    """Standard errors of a cohort of k clients drawn without replacement from
    ``population`` (Cochran, *Sampling Techniques*, 3rd ed.: eq. 2.12 for the mean,
    eq. 6.9 for the ratio estimator), with the finite-population correction 1 − k/M:

    - ``uniform_se``: √((1 − k/M) s²/k), s² the cohort's sample variance of the client
      values y_i (ddof 1);
    - ``se`` (of the sample-weighted mean R = Σ n_i y_i / Σ n_i):
      √((1 − k/M) / (k(k − 1)) · Σ (n_i/n̄)² (y_i − R)²), n̄ the cohort's mean n_i.

    Both are 0 when the cohort is the whole population, and NaN for fewer than 2 clients.

    >>> se = cohort_standard_errors([1.0, 0.0, 0.5], [1, 1, 2], population=6)
    >>> round(se["uniform_se"], 6), round(se["se"], 6)
    (0.204124, 0.153093)
    """
    y = np.asarray(means, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    k = len(y)
    if k < 2:
        return {"se": math.nan, "uniform_se": math.nan}
    correction = max(0.0, 1.0 - k / population)
    ratio = float((n * y).sum() / n.sum())
    spread = float((((n / n.mean()) * (y - ratio)) ** 2).sum())
    return {
        "se": math.sqrt(correction * spread / (k * (k - 1))),
        "uniform_se": math.sqrt(correction * float(y.var(ddof=1)) / k),
    }
