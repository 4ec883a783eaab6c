"""Partitioners: pure functions of (labels, seed) that split sample indices over clients.

Each returns a list with one sorted ``int64`` index array per client; every sample is
assigned exactly once.
"""

from __future__ import annotations

import numpy as np


def _labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0:
        raise ValueError("labels must be a non-empty 1-D array.")
    return labels


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    if num_clients > num_samples:
        raise ValueError(
            f"num_clients={num_clients} exceeds the {num_samples} samples; use fewer clients."
        )


def iid_partition(labels, num_clients: int, seed: int) -> list[np.ndarray]:
    """A uniformly random split into ``num_clients`` parts of (almost) equal size."""
    labels = _labels(labels)
    _check_num_clients(num_clients, len(labels))
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet_partition(
    labels, num_clients: int, alpha: float, seed: int, min_size: int = 0, max_tries: int = 1000
) -> list[np.ndarray]:
    """Label skew by a Dirichlet prior (Hsu et al. 2019, as in FedEM and FedLab).

    For every class k, proportions q_k ~ Dir(alpha·1_N) split that class's samples over
    the N clients. Small alpha gives skewed label histograms, large alpha near-IID ones.
    With ``min_size > 0`` the draw is repeated (same seed stream) until every client has
    at least ``min_size`` samples.
    """
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}; use e.g. alpha=0.5.")
    labels = _labels(labels)
    _check_num_clients(num_clients, len(labels))
    if min_size * num_clients > len(labels):
        raise ValueError(
            f"min_size={min_size} for {num_clients} clients needs more than the "
            f"{len(labels)} samples; lower min_size."
        )
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for k in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == k))
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"No Dirichlet({alpha}) split gave every client >= {min_size} samples in "
        f"{max_tries} tries; raise alpha or lower min_size."
    )


def shard_partition(
    labels, num_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
    """Pathological non-IID split of McMahan et al. (2017), §3.

    Sort by label, cut into ``num_clients·shards_per_client`` equal shards and give each
    client ``shards_per_client`` random shards, so each client sees about that many
    classes.
    """
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}.")
    labels = _labels(labels)
    num_shards = num_clients * shards_per_client
    _check_num_clients(num_shards, len(labels))
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, num_shards)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in assignment]


#: The partitions :func:`label_partition` draws.
LABEL_PARTITIONS = ("dirichlet", "iid", "shards", "one_class")


def check_label_partition(partition: str) -> None:
    """Refuse a partition :func:`label_partition` does not draw (at a constructor)."""
    if partition not in LABEL_PARTITIONS:
        raise ValueError(
            f"Unknown partition {partition!r}; use dirichlet, iid, shards or one_class."
        )


def label_partition(
    labels,
    partition: str,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    min_size: int = 0,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """One of the label-based splits by name: ``"iid"``, ``"dirichlet"`` (``alpha``,
    ``min_size``), ``"shards"`` (``shards_per_client``) or ``"one_class"``."""
    if partition == "iid":
        return iid_partition(labels, num_clients, seed)
    if partition == "dirichlet":
        return dirichlet_partition(labels, num_clients, alpha, seed, min_size=min_size)
    if partition == "shards":
        return shard_partition(labels, num_clients, shards_per_client, seed)
    if partition == "one_class":
        return one_class_partition(labels, num_clients, seed)
    check_label_partition(partition)
    raise AssertionError(partition)  # pragma: no cover - checked above


def one_class_partition(labels, num_clients: int, seed: int) -> list[np.ndarray]:
    """Client i holds only class i mod C, and the clients of a class share its samples in
    equal parts (shuffled with ``seed``): the unlearning experiments' MNIST split (Fraboni
    thesis §5.5, 10 clients per digit for 100 clients; the authors' code, policy P9)."""
    labels = _labels(labels)
    classes = np.unique(labels)
    _check_num_clients(num_clients, len(labels))
    if num_clients < len(classes):
        raise ValueError(
            f"one_class needs at least one client per class: {num_clients} clients for "
            f"{len(classes)} classes."
        )
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for k, cls in enumerate(classes):
        owners = list(range(k, num_clients, len(classes)))
        samples = rng.permutation(np.flatnonzero(labels == cls))
        for owner, chunk in zip(owners, np.array_split(samples, len(owners))):
            parts[owner] = np.sort(chunk)
    return parts


def split_fractions(
    indices: np.ndarray, fractions: tuple[float, ...], seed: int
) -> list[np.ndarray]:
    """Randomly split one client's indices into parts with the given fractions (sum 1)."""
    if any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split fractions must be >= 0 and sum to 1, got {fractions}.")
    shuffled = np.random.default_rng(seed).permutation(indices)
    cuts = np.round(np.cumsum(fractions)[:-1] * len(indices)).astype(int)
    return [np.sort(part) for part in np.split(shuffled, cuts)]


def server_split(size: int, server_samples: int, seed: int, what: str) -> tuple[np.ndarray, ...]:
    """(held, kept): ``server_samples`` indices of ``size`` drawn at random with (seed, 17)
    for the server's own data (SAFARI's auxiliary set), and the others, sorted, for the
    clients. ``what`` names the data in the error for an impossible size."""
    if not 0 <= server_samples < size:
        raise ValueError(
            f"server_samples must be in [0, {size}), got {server_samples}: {what} hold(s) "
            f"{size} samples."
        )
    order = np.random.default_rng([seed, 17]).permutation(size)
    return order[:server_samples], np.sort(order[server_samples:])


def random_subset(size: int, count: int | None, seed: int, what: str) -> np.ndarray:
    """``count`` of ``size`` indices drawn at random without replacement with (seed, 23),
    sorted; every index when ``count`` is None. ``what`` names the data in the error."""
    if count is None:
        return np.arange(size)
    if not 1 <= count <= size:
        raise ValueError(
            f"{what}: asked for {count} samples, but there are {size}; use 1 to {size}."
        )
    return np.sort(np.random.default_rng([seed, 23]).permutation(size)[:count])


def grouped_dirichlet_partition(
    labels, num_clients: int, alpha: float, num_groups: int, seed: int
) -> list[np.ndarray]:
    """FedEM's label split (Marfoq et al. 2021, App. D.1, ``split_dataset_by_labels``).

    The labels are shuffled into ``num_groups`` groups of (almost) equal size. For every
    group, weights w ~ Dir(alpha·1_N) and counts ~ Multinomial(group size, w) split the
    group's shuffled samples over the N clients. ``num_groups`` equal to the number of
    classes gives the plain per-label Dirichlet split.
    """
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}; use e.g. alpha=0.4.")
    labels = _labels(labels)
    _check_num_clients(num_clients, len(labels))
    classes = np.unique(labels)
    if not 1 <= num_groups <= len(classes):
        raise ValueError(f"num_groups must be in [1, {len(classes)}], got {num_groups}.")
    rng = np.random.default_rng(seed)
    groups = np.array_split(rng.permutation(classes), num_groups)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for group in groups:
        idx = rng.permutation(np.flatnonzero(np.isin(labels, group)))
        counts = rng.multinomial(len(idx), rng.dirichlet(np.full(num_clients, alpha)))
        for client, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            parts[client].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def pachinko_partition(
    coarse_labels,
    fine_labels,
    num_clients: int,
    samples_per_client: int,
    alpha: float,
    beta: float,
    seed: int,
) -> list[np.ndarray]:
    """Pachinko allocation for CIFAR-100 (Reddi et al., ICLR 2021, App. C.1; Li & McCallum 2006).

    Each client draws a multinomial over coarse labels from Dir(alpha) and, for each coarse
    label, a multinomial over its fine labels from Dir(beta). Its samples are then drawn one
    at a time: a coarse label, then a fine label within it, then a sample of that fine label
    without replacement. An exhausted fine label gets probability 0 (renormalized); so does
    a coarse label with no samples left.
    """
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"Pachinko alpha and beta must be > 0, got {alpha}, {beta}.")
    coarse, fine = _labels(coarse_labels), _labels(fine_labels)
    if len(coarse) != len(fine):
        raise ValueError("coarse_labels and fine_labels must have the same length.")
    if num_clients * samples_per_client > len(fine):
        raise ValueError(
            f"{num_clients} clients x {samples_per_client} samples exceed the {len(fine)} "
            "samples; lower samples_per_client."
        )
    rng = np.random.default_rng(seed)
    coarse_ids = np.unique(coarse)
    fine_of = {c: np.unique(fine[coarse == c]) for c in coarse_ids}
    pools = {f: list(rng.permutation(np.flatnonzero(fine == f))) for f in np.unique(fine)}
    parts = []
    for _ in range(num_clients):
        p_coarse = rng.dirichlet(np.full(len(coarse_ids), alpha))
        p_fine = {c: rng.dirichlet(np.full(len(fine_of[c]), beta)) for c in coarse_ids}
        taken: list[int] = []
        while len(taken) < samples_per_client:
            alive_fine = {c: np.array([len(pools[f]) > 0 for f in fine_of[c]]) for c in coarse_ids}
            pc = p_coarse * np.array([alive_fine[c].any() for c in coarse_ids])
            if pc.sum() == 0:  # every label this client can draw is exhausted: use any left
                pc = np.array([alive_fine[c].any() for c in coarse_ids], dtype=float)
            c = coarse_ids[rng.choice(len(coarse_ids), p=pc / pc.sum())]
            pf = p_fine[c] * alive_fine[c]
            if pf.sum() == 0:
                pf = alive_fine[c].astype(float)
            f = fine_of[c][rng.choice(len(fine_of[c]), p=pf / pf.sum())]
            taken.append(int(pools[f].pop()))
        parts.append(np.sort(np.asarray(taken, dtype=np.int64)))
    return parts


#: The clustered-sampling paper's CIFAR-10 client sizes (Fraboni et al. ICML 2021, §5):
#: 10% of the clients hold 100 training samples, 30% 250, 30% 500, 20% 750, 10% 1000.
UNBALANCED_SIZES = ((0.1, 100), (0.3, 250), (0.3, 500), (0.2, 750), (0.1, 1000))


def unbalanced_sizes(num_clients: int) -> list[int]:
    """The sizes of :data:`UNBALANCED_SIZES` for ``num_clients`` clients (48,500 for 100)."""
    sizes: list[int] = []
    for share, size in UNBALANCED_SIZES:
        sizes += [size] * round(share * num_clients)
    sizes += [UNBALANCED_SIZES[-1][1]] * (num_clients - len(sizes))
    return sizes[:num_clients]


def unbalanced_dirichlet_partition(
    train_labels, test_labels, num_clients: int, alpha: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The clustered-sampling paper's unbalanced split (its code): client c's class
    proportions q_c ~ Dir(α·1), its training samples (``unbalanced_sizes``) and test
    samples (a fifth as many) drawn class by class from the pools with replacement, with
    the same q_c for both."""
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}.")
    train_labels, test_labels = _labels(train_labels), _labels(test_labels)
    classes = np.unique(train_labels)
    rng = np.random.default_rng(seed)
    train_pools = [np.flatnonzero(train_labels == k) for k in classes]
    test_pools = [np.flatnonzero(test_labels == k) for k in classes]
    train_parts, test_parts = [], []
    for size in unbalanced_sizes(num_clients):
        q = rng.dirichlet(np.full(len(classes), alpha))
        for pools, n, parts in ((train_pools, size, train_parts),
                                (test_pools, max(1, size // 5), test_parts)):  # fmt: skip
            counts = rng.multinomial(n, q)
            parts.append(np.concatenate([rng.choice(pool, k, replace=True)
                                         for pool, k in zip(pools, counts) if k]))  # fmt: skip
    return train_parts, test_parts
