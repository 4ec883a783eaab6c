"""Throughput-optimal overlays for cross-silo FL (Marfoq, Xu, Neglia, Vidal, NeurIPS 2020;
Marfoq thesis §2.1 and App. C).

Pieces, each a pure function of its inputs:

- :func:`read_underlay` reads a network (GML) and :class:`SiloNetwork` turns it into the
  connectivity graph G_c between silos: shortest path on distance, path latency
  0.0085·km + 4 ms, available core bandwidth A = (slowest link on the path) / hops, and
  one access link per silo (§2.1.4, as the authors' code builds it);
- :class:`DelayModel` gives the arc delays of an overlay (eq. 2.3);
- :func:`cycle_time` is the max-plus cycle time τ (eq. 2.5) by Karp's algorithm,
  :func:`tree_cycle_time` the tree shortcut (Lemma C.2) and :func:`simulate` the max-plus
  recurrence (eq. 2.4, the time simulator of Alg. 5);
- :func:`star`, :func:`mst`, :func:`delta_mbst` and :func:`ring` build the overlays of
  Table 2.1, and :func:`matcha_cycle_time` the MATCHA baseline (Misra–Gries matchings,
  the SDP of Wang et al. 2019 eq. 5 for their activation probabilities);
- :func:`local_degree_weights` is the consensus matrix of eqs. 2.12–2.13.

Units: milliseconds for time, bits for the model, bit/s for capacities.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import networkx as nx
import numpy as np
from scipy.sparse.csgraph import connected_components

#: The networks shipped with the package (lightning_fl/systems/networks/, Apache-2.0).
NETWORKS = ("gaia", "amazon_us", "geantdistance", "exodus", "ebone")
#: Latency of a path: 0.0085 ms per km plus 4 ms once per path [Gue+04], §2.1.4.1.
MS_PER_KM, PATH_LATENCY_MS = 0.0085, 4.0
EARTH_RADIUS_KM = 6371.0


class TopologyError(ValueError):
    """A network, overlay or delay parameter that cannot describe a cross-silo system."""


def read_underlay(source: str | Path) -> nx.Graph:
    """The underlay G_u from a GML file, or one of :data:`NETWORKS` by name.

    Every edge needs its length in km: a ``distance`` attribute, or ``Latitude`` and
    ``Longitude`` on both end nodes (great-circle distance). GML is parsed as data, never
    evaluated.
    """
    path = Path(source)
    if str(source) in NETWORKS:
        path = Path(str(resources.files("lightning_fl.systems") / "networks" / f"{source}.gml"))
    if not path.is_file():
        raise TopologyError(
            f"No network file {str(source)!r}: give a GML path or one of {', '.join(NETWORKS)}."
        )
    try:
        graph = nx.read_gml(path)
    except (nx.NetworkXError, ValueError) as err:
        raise TopologyError(f"{path} is not a readable GML graph ({err}).") from err
    graph = nx.Graph(graph)  # an undirected simple graph, as the authors read it
    graph.remove_edges_from(nx.selfloop_edges(graph))
    if graph.number_of_nodes() < 2:
        raise TopologyError(f"{path} has {graph.number_of_nodes()} node(s): a network needs 2.")
    for u, v, data in graph.edges(data=True):
        if "distance" not in data:
            data["distance"] = _great_circle_km(graph, path, u, v)
        if not math.isfinite(float(data["distance"])) or float(data["distance"]) < 0:
            raise TopologyError(
                f"{path}: edge ({u}, {v}) has distance {data['distance']}: give a length >= 0 km."
            )
    if not nx.is_connected(graph):
        parts = nx.number_connected_components(graph)
        raise TopologyError(
            f"{path} is disconnected ({parts} components): some silos could never exchange "
            "models; add the missing links or drop the isolated silos."
        )
    return graph


def _great_circle_km(graph: nx.Graph, path: Path, u: object, v: object) -> float:
    try:
        lat1, lon1 = (math.radians(float(graph.nodes[u][k])) for k in ("Latitude", "Longitude"))
        lat2, lon2 = (math.radians(float(graph.nodes[v][k])) for k in ("Latitude", "Longitude"))
    except KeyError:
        raise TopologyError(
            f"{path}: edge ({u}, {v}) has no 'distance' and its nodes no Latitude/Longitude "
            "coordinates: add one of them to the GML file."
        ) from None
    h = (
        math.sin((lat2 - lat1) / 2) ** 2
        + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    )
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def _per_silo(value: float | Sequence[float], n: int, name: str) -> np.ndarray:
    array = np.full(n, float(value)) if np.isscalar(value) else np.asarray(value, dtype=float)
    if array.shape != (n,):
        raise TopologyError(
            f"{name} has {array.size} values for {n} silos: give one per silo (or one number)."
        )
    if not np.all(array > 0):
        bad = int(np.flatnonzero(~(array > 0))[0])
        raise TopologyError(
            f"{name}[{bad}] = {array[bad]}: every silo needs a positive value "
            "(an access link in bit/s, a compute time in ms)."
        )
    return array


@dataclass(frozen=True)
class SiloNetwork:
    """The connectivity graph G_c between silos (thesis §2.1.2.2, built as in §2.1.4.1).

    ``latency_ms[i, j]`` is l(i, j), ``bandwidth_bps[i, j]`` the core bandwidth A(i', j'),
    ``upload_bps`` and ``download_bps`` the access links C_UP and C_DN, and ``underlay``
    marks the silo pairs joined by a physical link (MATCHA⁺ draws its matchings there).
    """

    names: tuple[str, ...]
    latency_ms: np.ndarray
    bandwidth_bps: np.ndarray
    upload_bps: np.ndarray
    download_bps: np.ndarray
    underlay: np.ndarray
    #: the underlay's links and G_c's silo pairs (i, j) in the order the GML file and
    #: the shortest-path search first give them: MATCHA's edge colouring follows it
    link_order: tuple[tuple[int, int], ...] = ()
    pair_order: tuple[tuple[int, int], ...] = ()

    @property
    def num_silos(self) -> int:
        return len(self.names)

    @classmethod
    def from_underlay(
        cls,
        underlay: nx.Graph | str | Path,
        access_bps: float | Sequence[float] = 1e10,
        core_bps: float | None = 1e9,
    ) -> SiloNetwork:
        """Every node of the underlay is a silo behind an access link of ``access_bps``
        (up and down). Silo pairs talk along the shortest path on distance; its latency is
        0.0085·km + 4 ms and its bandwidth is the slowest link's capacity divided by the
        hop count, the share a path gets of 1 Gbps core links in the authors' simulator.

        ``core_bps`` is every core link's capacity, as in the paper's experiments and the
        authors' code (which ignores the GML ``capacity``); ``None`` reads ``capacity``
        from each edge instead.
        """
        graph = underlay if isinstance(underlay, nx.Graph) else read_underlay(underlay)
        names = tuple(str(node) for node in graph.nodes)
        n = len(names)
        index = {node: i for i, node in enumerate(graph.nodes)}
        latency = np.zeros((n, n))
        bandwidth = np.full((n, n), np.inf)
        linked = _links(graph, index, core_bps)
        link_order = tuple((index[u], index[v]) for u, v in graph.edges)
        pairs = [
            (index[source], index[target])
            for source in graph.nodes
            for target in _discovery_order(graph, source)
        ]
        for source, paths in nx.all_pairs_dijkstra_path(graph, weight="distance"):
            for target, path in paths.items():
                if source == target:
                    continue
                links = [graph.edges[a, b] for a, b in zip(path[:-1], path[1:])]
                km = sum(float(link["distance"]) for link in links)
                slowest = core_bps or min(float(link["capacity"]) for link in links)
                i, j = index[source], index[target]
                latency[i, j] = MS_PER_KM * km + PATH_LATENCY_MS
                bandwidth[i, j] = slowest / len(links)
        access = _per_silo(access_bps, n, "access_bps")
        return cls(
            names, latency, bandwidth, access, access.copy(), linked, link_order, tuple(pairs)
        )


def _links(graph: nx.Graph, index: dict, core_bps: float | None) -> np.ndarray:
    """The underlay's adjacency (n × n, symmetric), after checking the capacities that
    ``core_bps`` (None: each edge's own) gives every core link."""
    n = len(index)
    linked = np.zeros((n, n), dtype=bool)
    for u, v, data in graph.edges(data=True):
        linked[index[u], index[v]] = linked[index[v], index[u]] = True
        if core_bps is None and not float(data.get("capacity", 0)) > 0:
            raise TopologyError(
                f"Edge ({u}, {v}) has no positive 'capacity': add capacities to the GML "
                "file or give core_bps (1e9 in the paper)."
            )
    if core_bps is not None and not core_bps > 0:
        raise TopologyError(f"core_bps must be > 0 bit/s, got {core_bps}.")
    return linked


def _discovery_order(graph: nx.Graph, source: object) -> list[object]:
    """The nodes other than ``source`` in the order Dijkstra's search on distance first
    reaches them (neighbours relaxed in adjacency order, ties popped first-pushed): the
    order in which the authors' code (networkx 2) adds G_c's pairs."""
    reached, done = {source: 0.0}, set()
    order: list[object] = []
    heap = [(0.0, 0, source)]
    pushes = 1
    while heap:
        d, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        for neighbour, data in graph.adj[node].items():
            length = d + float(data["distance"])
            if neighbour not in done and (neighbour not in reached or length < reached[neighbour]):
                if neighbour not in reached:
                    order.append(neighbour)
                reached[neighbour] = length
                heapq.heappush(heap, (length, pushes, neighbour))
                pushes += 1
    return order


@dataclass(frozen=True)
class DelayModel:
    """Arc delays of an overlay, thesis eq. 2.3:

    d_o(i, j) = s·T_c(i) + l(i, j) + M / min(C_UP(i)/|N_i⁻|, C_DN(j)/|N_j⁺|, A(i', j')),
    d_o(i, i) = s·T_c(i),

    with M the model size (bits), s the local steps and T_c(i) the time of one local step
    (ms; Table 2.4, or measured on the user's model).
    """

    model_size_bits: float
    compute_ms: float | Sequence[float]
    local_steps: int = 1

    def __post_init__(self) -> None:
        if not self.model_size_bits > 0:
            raise TopologyError(f"model_size_bits must be > 0, got {self.model_size_bits}.")
        if isinstance(self.local_steps, bool) or int(self.local_steps) < 1:
            raise TopologyError(f"local_steps must be >= 1, got {self.local_steps}.")

    def compute(self, n: int) -> np.ndarray:
        """s·T_c(i) for every silo (ms)."""
        return self.local_steps * _per_silo(self.compute_ms, n, "compute_ms")

    def transfer_ms(self, network: SiloNetwork, arcs: np.ndarray) -> np.ndarray:
        """M / min(C_UP(i)/|N_i⁻|, C_DN(j)/|N_j⁺|, A(i', j')) on every arc, in ms."""
        out_degree = arcs.sum(axis=1, keepdims=True)
        in_degree = arcs.sum(axis=0, keepdims=True)
        with np.errstate(divide="ignore"):
            rate = np.minimum(
                np.minimum(
                    network.upload_bps[:, None] / out_degree,
                    network.download_bps[None, :] / in_degree,
                ),
                network.bandwidth_bps,
            )
        return 1e3 * self.model_size_bits / rate

    def arc_delays(
        self, network: SiloNetwork, arcs: np.ndarray, computes: np.ndarray | None = None
    ) -> np.ndarray:
        """The n×n delay matrix d_o (ms) of the overlay ``arcs`` (``arcs[i, j]``: i sends
        to j); −inf where there is no arc, s·T_c(i) on the diagonal."""
        n = network.num_silos
        arcs = np.asarray(arcs, dtype=bool) & ~np.eye(n, dtype=bool)
        compute = self.compute(n) if computes is None else computes
        delays = compute[:, None] + network.latency_ms + self.transfer_ms(network, arcs)
        delays = np.where(arcs, delays, -np.inf)
        np.fill_diagonal(delays, compute)
        return delays


@dataclass(frozen=True)
class Overlay:
    """A communication overlay G_o: ``arcs[i, j]`` is True when silo i sends its model to
    silo j. ``orchestrator`` marks STAR's centre: it only averages (no local computation),
    and a round is two max-plus steps (upload, then broadcast)."""

    name: str
    arcs: np.ndarray
    orchestrator: int | None = None

    @property
    def steps_per_round(self) -> int:
        return 1 if self.orchestrator is None else 2

    def delays(self, network: SiloNetwork, model: DelayModel) -> np.ndarray:
        computes = model.compute(network.num_silos)
        if self.orchestrator is not None:
            computes = computes.copy()
            computes[self.orchestrator] = 0.0
        return model.arc_delays(network, self.arcs, computes)

    def cycle_time(self, network: SiloNetwork, model: DelayModel) -> float:
        """Time per communication round (ms): τ of eq. 2.5, times 2 for STAR, whose
        round is an upload and a broadcast (the authors' code: 2(τ − s·T_c) + s·T_c)."""
        return self.steps_per_round * cycle_time(self.delays(network, model))

    def mixing_matrix(self) -> np.ndarray:
        """W[j, i], the weight silo i gives to silo j's model: the local-degree rule, or
        the orchestrator's plain average 1/N for STAR."""
        n = len(self.arcs)
        if self.orchestrator is not None:
            return np.full((n, n), 1.0 / n)
        return local_degree_weights(self.arcs)


def _check_strongly_connected(arcs: np.ndarray) -> None:
    parts, _ = connected_components(np.asarray(arcs, dtype=bool), connection="strong")
    if parts > 1:
        raise TopologyError(
            f"The overlay is not strongly connected ({parts} strong components): some silos "
            "would never receive the others' models; add arcs so every silo reaches every other."
        )


def cycle_time(delays: np.ndarray) -> float:
    """The maximum cycle mean of a strongly connected weighted digraph (thesis eq. 2.5),
    by Karp's algorithm [Kar78]: with D_k(v) the heaviest k-arc walk from silo 0 to v,
    τ = max_v min_{0≤k<n} (D_n(v) − D_k(v)) / (n − k). ``delays`` holds d_o(i, j), −inf
    where there is no arc. O(n³) with numpy.

    A ring 0 → 1 → 2 → 0 of delays 2, 4, 3 (and 0 on the diagonal, each silo's own
    compute): its one cycle has mean (2 + 4 + 3)/3 = 3, the time a round takes in the
    long run (:func:`simulate` reaches t(3) = 9 everywhere).

    >>> import numpy as np
    >>> never = -np.inf
    >>> delays = np.array([[0.0, 2, never], [never, 0, 4], [3, never, 0]])
    >>> cycle_time(delays)
    3.0
    >>> simulate(delays, 3)[-1].tolist()
    [9.0, 9.0, 9.0]
    """
    delays = np.asarray(delays, dtype=float)
    n = len(delays)
    arcs = np.isfinite(delays)
    np.fill_diagonal(arcs, False)
    if n > 1:
        _check_strongly_connected(arcs)
    walks = np.full((n + 1, n), -np.inf)
    walks[0, 0] = 0.0
    for k in range(1, n + 1):
        walks[k] = np.max(walks[k - 1][:, None] + delays, axis=0)
    steps = (n - np.arange(n))[:, None]
    with np.errstate(invalid="ignore"):
        means = (walks[n][None, :] - walks[:n]) / steps
    means = np.where(np.isfinite(walks[:n]), means, np.inf)
    best = means.min(axis=0)
    return float(np.max(np.where(np.isfinite(walks[n]), best, -np.inf)))


def tree_cycle_time(delays: np.ndarray) -> float:
    """Lemma C.2: on an undirected tree, τ = max over edges of (d(i, j) + d(j, i)) / 2."""
    delays = np.asarray(delays, dtype=float)
    arcs = np.isfinite(delays)
    np.fill_diagonal(arcs, False)
    n = len(delays)
    if not (np.array_equal(arcs, arcs.T) and arcs.sum() == 2 * (n - 1)):
        raise TopologyError("tree_cycle_time needs an undirected tree (n − 1 symmetric edges).")
    both = np.where(arcs, delays + delays.T, -np.inf) / 2
    return float(max(both.max(), np.diag(delays).max()))


def simulate(delays: np.ndarray, rounds: int, start: np.ndarray | None = None) -> np.ndarray:
    """The max-plus recurrence t_i(k+1) = max_{j ∈ N_i⁺ ∪ {i}} t_j(k) + d_o(j, i)
    (thesis eq. 2.4; Alg. 5 with sender j and receiver i). Returns t(0..rounds), one row
    per step, from ``start`` (zeros by default)."""
    delays = np.asarray(delays, dtype=float)
    times = np.zeros((rounds + 1, len(delays)))
    if start is not None:
        times[0] = start
    for k in range(1, rounds + 1):
        times[k] = np.max(times[k - 1][:, None] + delays, axis=0)
    return times


def local_degree_weights(arcs: np.ndarray) -> np.ndarray:
    """The local-degree consensus matrix (thesis eqs. 2.12–2.13, [LB03]):
    A_ij = 1 / (1 + max(|N_i⁻|, |N_j⁻|)) on each arc i → j and A_ii = 1 − Σ_{j∈N_i⁻} A_ij.
    Returned as W[j, i], the weight receiver i gives sender j (W[i, j] = A_ij on arc
    i → j); doubly stochastic on undirected overlays and on rings."""
    arcs = np.asarray(arcs, dtype=bool) & ~np.eye(len(arcs), dtype=bool)
    out_degree = arcs.sum(axis=1)
    pair = 1.0 / (1.0 + np.maximum(out_degree[:, None], out_degree[None, :]))
    weights = np.where(arcs, pair, 0.0)
    np.fill_diagonal(weights, 1.0 - weights.sum(axis=1))
    return weights


# ---- overlays of Table 2.1 --------------------------------------------------------------


def _undirected_arcs(edges: list[tuple[int, int]], n: int) -> np.ndarray:
    arcs = np.zeros((n, n), dtype=bool)
    for u, v in edges:
        arcs[u, v] = arcs[v, u] = True
    return arcs


def _degree_one_delays(network: SiloNetwork, model: DelayModel) -> np.ndarray:
    """d(i, j) of eq. 2.3 when i sends only to j and j receives only from i. Their
    symmetrization d^(u)(i, j) = (d(i, j) + d(j, i))/2 weighs MST (Prop. 2.1.1) and
    Algorithm 3; with C_DN = A = ∞ it is Alg. 3's [s(T_c(i) + T_c(j)) + l(i, j) + l(j, i) +
    M/C_UP(i) + M/C_UP(j)] / 2."""
    n = network.num_silos
    compute = model.compute(n)
    rate = np.minimum(
        np.minimum(network.upload_bps[:, None], network.download_bps[None, :]),
        network.bandwidth_bps,
    )
    delays = compute[:, None] + network.latency_ms + 1e3 * model.model_size_bits / rate
    np.fill_diagonal(delays, compute)
    return delays


def _complete_graph(weights: np.ndarray) -> nx.Graph:
    n = len(weights)
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_weighted_edges_from((i, j, weights[i, j]) for i in range(n) for j in range(i + 1, n))
    return graph


def star(network: SiloNetwork, model: DelayModel, centrality: str = "load") -> Overlay:
    """STAR: every silo exchanges with an orchestrator at the silo of highest load
    centrality of G_c (latency-weighted), as in §2.1.4 and the authors' code."""
    del model
    latency = _complete_graph(network.latency_ms)
    for u, v in latency.edges:
        latency.edges[u, v]["latency"] = latency.edges[u, v].pop("weight")
    if centrality == "load":
        scores = nx.load_centrality(latency, weight="latency")
    elif centrality == "closeness":
        scores = nx.closeness_centrality(latency, distance="latency")
    else:
        raise TopologyError(f"centrality must be 'load' or 'closeness', got {centrality!r}.")
    centre = max(scores, key=lambda node: (scores[node], -node))
    n = network.num_silos
    return Overlay(
        "STAR", _undirected_arcs([(centre, i) for i in range(n) if i != centre], n), centre
    )


def mst(network: SiloNetwork, model: DelayModel) -> Overlay:
    """MST (Prim) of G_c under d^(u): the optimal undirected overlay when access links are
    not the bottleneck (edge-capacitated, Prop. 2.1.1)."""
    weights = _degree_one_delays(network, model)
    tree = nx.minimum_spanning_tree(_complete_graph((weights + weights.T) / 2), algorithm="kruskal")
    return Overlay("MST", _undirected_arcs(list(tree.edges), network.num_silos))


def delta_prim(weights: np.ndarray, delta: int) -> list[tuple[int, int]]:
    """δ-Prim: Prim from silo 0 where a tree node of degree δ takes no new edge
    (Algorithm 3, line 3). Ties go to the earliest tree node, then the lowest silo index,
    as in the authors' code. Returns the tree's edges."""
    n = len(weights)
    order = [0]  # tree nodes in the order they joined
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    degree = np.zeros(n, dtype=int)
    edges = []
    for _ in range(n - 1):
        rows = np.array(order)
        open_rows = degree[rows] < delta
        candidates = np.where(open_rows[:, None] & ~in_tree[None, :], weights[rows], np.inf)
        r, v = np.unravel_index(np.argmin(candidates), candidates.shape)
        if not np.isfinite(candidates[r, v]):
            raise TopologyError(f"δ-Prim with δ = {delta} cannot span the network.")
        u = int(rows[r])
        edges.append((u, int(v)))
        order.append(int(v))
        in_tree[v] = True
        degree[u] += 1
        degree[v] += 1
    return edges


def tree_cube_hamiltonian_path(edges: list[tuple[int, int]], n: int) -> list[int]:
    """A Hamiltonian path of T³, the cube of the tree T (Algorithm 3, line 2). The cube of a
    tree is Hamiltonian-connected between adjacent vertices [Sekanina]: split T at an edge
    (u, v); a path of T_u³ from u to a neighbour u′, the hop u′ → v′ (three tree edges),
    and a path of T_v³ from a neighbour v′ of v to v."""
    neighbours: dict[int, list[int]] = {i: [] for i in range(n)}
    for u, v in edges:
        neighbours[u].append(v)
        neighbours[v].append(u)

    def side(root: int, cut: int) -> list[int]:  # the vertices on root's side of edge root–cut
        seen, stack = {root}, [root]
        while stack:
            node = stack.pop()
            for other in neighbours[node]:
                if other not in seen and not (node == root and other == cut):
                    seen.add(other)
                    stack.append(other)
        return sorted(seen)

    def path(u: int, v: int, allowed: set[int]) -> list[int]:  # u … v through all of allowed
        part_u = [x for x in side(u, v) if x in allowed]
        part_v = [x for x in side(v, u) if x in allowed]
        first = [u]
        if len(part_u) > 1:
            u_next = min(x for x in neighbours[u] if x in part_u)
            first = path(u, u_next, set(part_u))
        last = [v]
        if len(part_v) > 1:
            v_next = min(x for x in neighbours[v] if x in part_v)
            last = path(v, v_next, set(part_v))[::-1]
        return first + last

    if n == 1:
        return [0]
    u, v = edges[0]
    return path(u, v, set(range(n)))


def delta_mbst(network: SiloNetwork, model: DelayModel) -> Overlay:
    """δ-MBST, Algorithm 3 (node-capacitated, undirected): among the Hamiltonian path of
    the MST cube (a 2-MBST approximation) and the δ-Prim trees for δ = 2..N, the tree
    with the smallest cycle time under eq. 2.3 with its own degrees."""
    n = network.num_silos
    weights = _degree_one_delays(network, model)
    weights = (weights + weights.T) / 2
    np.fill_diagonal(weights, np.inf)
    tree = nx.minimum_spanning_tree(_complete_graph(weights), algorithm="kruskal")
    order = tree_cube_hamiltonian_path(sorted(tree.edges), n)
    candidates = [list(zip(order[:-1], order[1:]))]
    candidates += [delta_prim(weights, delta) for delta in range(2, n + 1)]
    best, best_time = None, np.inf
    for edges in candidates:
        overlay = Overlay("δ-MBST", _undirected_arcs(edges, n))
        time = overlay.cycle_time(network, model)
        if time < best_time:
            best, best_time = overlay, time
    return best


def ring(network: SiloNetwork, model: DelayModel) -> Overlay:
    """RING: a Christofides tour of G_c under d′(i, j) = s·T_c(i) + l(i, j) +
    M/min(C_UP(i), C_DN(j), A(i′, j′)) (§2.1.3, Prop. 2.1.3/2.1.6), symmetrized for the
    tour, then directed the way with the smaller cycle time."""
    n = network.num_silos
    if n == 2:
        tour = [0, 1, 0]
    else:
        weights = _degree_one_delays(network, model)
        tour = nx.approximation.christofides(_complete_graph((weights + weights.T) / 2))
    directions = []
    for order in (tour, tour[::-1]):
        arcs = np.zeros((n, n), dtype=bool)
        for u, v in zip(order[:-1], order[1:]):
            arcs[u, v] = True
        overlay = Overlay("RING", arcs)
        directions.append((overlay.cycle_time(network, model), overlay))
    return min(directions, key=lambda pair: pair[0])[1]


class _EdgeColouring:
    """Misra & Gries's edge colouring (Inf. Process. Lett. 41, 1992) of a simple graph with
    Δ + 1 colours, the decomposition MATCHA draws its matchings from (Wang et al. 2019,
    §3). Neighbours are kept, and scanned, in the order their edges were added, and the
    smallest free colour is taken at every choice, so the colouring is a function of the
    edge order."""

    def __init__(self, n: int, edges: Sequence[tuple[int, int]]) -> None:
        self.adjacency: list[dict[int, int | None]] = [{} for _ in range(n)]
        for u, v in edges:
            if u != v:
                self.adjacency[u].setdefault(v, None)
                self.adjacency[v].setdefault(u, None)
        self.colours = range(max((len(a) for a in self.adjacency), default=0) + 1)

    def edges(self) -> list[tuple[int, int]]:
        """Every edge once, node by node in adjacency order (networkx's edge order)."""
        seen: set[int] = set()
        out = []
        for u, neighbours in enumerate(self.adjacency):
            out.extend((u, v) for v in neighbours if v not in seen)
            seen.add(u)
        return out

    def _free(self, node: int, colour: int | None) -> bool:
        return colour not in self.adjacency[node].values()

    def _set(self, u: int, v: int, colour: int | None) -> None:
        self.adjacency[u][v] = self.adjacency[v][u] = colour

    def _fan(self, u: int, v: int) -> list[int]:
        """A maximal fan of u from v: distinct neighbours F with (u, F[0]) uncoloured and
        the colour of (u, F[i+1]) free on F[i]."""
        fan = [v]
        grown = True
        while grown:
            grown = False
            for node, colour in self.adjacency[u].items():
                if colour is not None and node not in fan and self._free(fan[-1], colour):
                    fan.append(node)
                    grown = True
                    break
        return fan

    def _cd_path(self, u: int, c: int, d: int) -> list[tuple[int, int]]:
        """The maximal path from u whose edges alternate the colours d, c, d, ..."""
        path, node, colour = [], u, d
        while True:
            nxt = next((w for w, col in self.adjacency[node].items() if col == colour), None)
            if nxt is None:
                return path
            path.append((node, nxt))
            node, colour = nxt, (c if colour == d else d)

    def colour(self) -> list[list[tuple[int, int]]]:
        """The colour classes 0..Δ in colour order (a class may be empty)."""
        for u, v in self.edges():
            if self.adjacency[u][v] is None:
                self._colour_edge(u, v)
        classes: list[list[tuple[int, int]]] = [[] for _ in self.colours]
        for u, v in self.edges():
            classes[self.adjacency[u][v]].append((u, v))
        return classes

    def _colour_edge(self, u: int, v: int) -> None:
        fan = self._fan(u, v)
        c = next(col for col in self.colours if self._free(u, col))
        d = next(col for col in self.colours if self._free(fan[-1], col))
        path = self._cd_path(u, c, d)
        on_path = {node for edge in path for node in edge}
        sub_fan = [v]
        for node in fan[1:]:
            if self.adjacency[u][node] == d:
                break
            sub_fan.append(node)
        if sub_fan[-1] in on_path:
            sub_fan = fan
        for a, b in path:  # invert the cd-path
            self._set(a, b, d if self.adjacency[a][b] == c else c)
        for i in range(len(sub_fan) - 1):  # rotate the fan
            self._set(u, sub_fan[i], self.adjacency[u][sub_fan[i + 1]])
        self._set(u, sub_fan[-1], d)


def misra_gries_matchings(n: int, edges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The Δ + 1 matchings of MATCHA's decomposition of the graph on ``n`` nodes with
    ``edges`` (in the order given: Misra–Gries's colouring depends on it)."""
    return _EdgeColouring(n, edges).colour()


def _laplacian(matching: Sequence[tuple[int, int]], n: int) -> np.ndarray:
    laplacian = np.zeros((n, n))
    for i, j in matching:
        laplacian[i, j] = laplacian[j, i] = -1.0
        laplacian[i, i] += 1.0
        laplacian[j, j] += 1.0
    return laplacian


def matcha_probabilities(
    matchings_: Sequence[Sequence[tuple[int, int]]], n: int, budget: float
) -> np.ndarray:
    """MATCHA's activation probabilities (Wang et al. 2019, eq. 5): the p that maximizes
    the algebraic connectivity λ₂ of the expected Laplacian Σ_j p_j L_j subject to
    0 ≤ p_j ≤ 1 and Σ_j p_j ≤ C_b·m, as the SDP max γ s.t. γI − β11ᵀ ⪯ Σ_j p_j L_j.
    Needs cvxpy (``pip install 'lightning-fl[topology]'``)."""
    try:
        import cvxpy as cp
    except ImportError:
        raise TopologyError(
            "MATCHA's SDP probabilities need cvxpy: pip install 'lightning-fl[topology]', "
            "or pass probabilities='uniform' (p = C_b for every matching)."
        ) from None
    laplacians = [_laplacian(m, n) for m in matchings_]
    m = len(laplacians)
    p, gamma, beta = cp.Variable(m), cp.Variable(), cp.Variable()
    expected = sum(p[j] * laplacians[j] for j in range(m))
    constraints = [
        p >= 0,
        p <= 1,
        cp.sum(p) <= budget * m,
        gamma * np.eye(n) - beta * np.ones((n, n)) << expected,
    ]
    cp.Problem(cp.Maximize(gamma), constraints).solve()
    if p.value is None:
        raise TopologyError(f"MATCHA's SDP found no solution for {n} silos and {m} matchings.")
    return np.clip(np.asarray(p.value, dtype=float), 0.0, 1.0)


def matcha_cycle_time(
    network: SiloNetwork,
    model: DelayModel,
    budget: float = 0.5,
    base: str = "connectivity",
    rounds: int = 1000,
    seed: int = 0,
    probabilities: str = "sdp",
) -> float:
    """The mean round time of MATCHA (Wang et al. 2019) with communication budget C_b:
    the base graph is split into the Δ + 1 matchings of Misra–Gries's colouring; each
    round activates matching j independently with probability p_j (redrawn while none is
    active) and lasts as long as its slowest arc under eq. 2.3 with the degrees of the
    active subgraph, as the authors' simulator measures it.

    ``base="connectivity"`` starts from G_c (MATCHA), ``"underlay"`` from the physical
    links (MATCHA⁺), each in the order the authors' code builds its graph.
    ``probabilities="sdp"`` solves MATCHA's SDP (:func:`matcha_probabilities`, cvxpy);
    ``"uniform"`` uses p_j = C_b, which meets the same budget. The activations are
    numpy's legacy ``RandomState(seed).binomial`` draws, the authors' generator. The
    mean is over ``rounds`` rounds (the authors' code divides their sum by rounds − 1).
    """
    if not 0.0 < budget <= 1.0:
        raise TopologyError(f"budget must be in (0, 1], got {budget}.")
    n = network.num_silos
    if base == "connectivity":
        order = network.pair_order or [(i, j) for i in range(n) for j in range(n) if i != j]
    elif base == "underlay":
        order = network.link_order or list(zip(*np.nonzero(np.triu(network.underlay))))
    else:
        raise TopologyError(f"base must be 'connectivity' or 'underlay', got {base!r}.")
    groups = misra_gries_matchings(n, order)
    if probabilities == "sdp":
        p = matcha_probabilities(groups, n, budget)
    elif probabilities == "uniform":
        p = np.full(len(groups), budget)
    else:
        raise TopologyError(f"probabilities must be 'sdp' or 'uniform', got {probabilities!r}.")
    rng = np.random.RandomState(seed)
    total = 0.0
    for _ in range(rounds):
        active = rng.binomial(1, p).astype(bool)
        while not active.any():
            active = rng.binomial(1, p).astype(bool)
        arcs = _undirected_arcs([e for g, on in zip(groups, active) if on for e in g], n)
        if arcs.any():
            total += float(model.arc_delays(network, arcs)[arcs].max())
        else:  # only empty colour classes drawn: the round is the computation alone
            total += float(model.compute(n).max())
    return total / rounds


#: Overlay builders by name, for recipes.
OVERLAYS = {"star": star, "mst": mst, "delta_mbst": delta_mbst, "ring": ring}


def build_overlay(name: str, network: SiloNetwork, model: DelayModel) -> Overlay:
    """The overlay ``name`` (one of :data:`OVERLAYS`) for ``network`` under ``model``."""
    if name not in OVERLAYS:
        raise TopologyError(f"overlay must be one of {', '.join(OVERLAYS)}, got {name!r}.")
    return OVERLAYS[name](network, model)


class MaxPlusClock:
    """Simulated wall-clock time of decentralized rounds over an overlay: the max-plus
    recurrence of eq. 2.4 advanced one round at a time (two steps for STAR). ``now`` is
    the time at which the last silo finishes the current round, logged as ``fl/time``.
    Its state (one float per silo) is saved in checkpoints."""

    def __init__(self, delays: np.ndarray, steps_per_round: int = 1) -> None:
        self.delays = np.asarray(delays, dtype=float)
        self.steps_per_round = steps_per_round
        self.times = np.zeros(len(self.delays))

    @property
    def now(self) -> float:
        return float(self.times.max())

    def advance(self) -> float:
        """End one round; returns the new ``now`` (ms)."""
        self.times = simulate(self.delays, self.steps_per_round, self.times)[-1]
        return self.now

    def state_dict(self) -> dict:
        return {"times": [float(t) for t in self.times]}

    def load_state_dict(self, state: dict) -> None:
        self.times = np.asarray(state["times"], dtype=float)


#: Time of one local step on an NVIDIA P100 (ms), thesis Table 2.4.
COMPUTE_MS = {
    "shakespeare": 389.6,
    "femnist": 4.6,
    "sent140": 9.8,
    "sub_inaturalist": 25.4,
    "inaturalist": 946.7,
}


class SiloTopology:
    """A decentralized deployment: the silos of ``network`` joined by the overlay
    ``overlay`` (``"star"``, ``"mst"``, ``"delta_mbst"`` or ``"ring"``), and the clock of
    its rounds. :class:`~lightning_fl.callbacks.GossipAveraging` mixes over it (DPASGD,
    eq. 2.2) and logs each round's simulated time as ``fl/time``.

    Args:
        network: one of :data:`NETWORKS` or a GML path; client i is its i-th silo.
        overlay: the overlay to build (Table 2.1).
        compute_ms: T_c, the time of one local step in ms (one value or one per silo;
            Table 2.4 values in :data:`COMPUTE_MS`).
        access_bps: each silo's access link (up and down), bit/s.
        core_bps: the core links' capacity, bit/s (``None``: the GML ``capacity``).
        model_size_bits: M; by default 32 bits per parameter of the trained model.
        local_steps: s; by default the strategy's ``local_steps``.
    """

    def __init__(
        self,
        network: str = "gaia",
        overlay: str = "ring",
        compute_ms: float | list[float] = COMPUTE_MS["femnist"],
        access_bps: float | list[float] = 1e10,
        core_bps: float | None = 1e9,
        model_size_bits: float | None = None,
        local_steps: int | None = None,
    ) -> None:
        if overlay not in OVERLAYS:
            raise TopologyError(f"overlay must be one of {', '.join(OVERLAYS)}, got {overlay!r}.")
        values = [compute_ms] if np.isscalar(compute_ms) else list(compute_ms)
        _per_silo(values, len(values), "compute_ms")
        self.network_name, self.overlay_name = network, overlay
        self.compute_ms, self.model_size_bits, self.local_steps = (
            compute_ms,
            model_size_bits,
            local_steps,
        )
        self.network = SiloNetwork.from_underlay(network, access_bps=access_bps, core_bps=core_bps)

    def build(
        self, num_silos: int, model_size_bits: float, local_steps: int | None
    ) -> tuple[Overlay, MaxPlusClock]:
        """The overlay and a fresh clock for ``num_silos`` clients."""
        if num_silos != self.network.num_silos:
            raise TopologyError(
                f"Network {self.network_name!r} has {self.network.num_silos} silos but "
                f"{num_silos} clients have training data: use {self.network.num_silos} clients "
                "(e.g. num_clients in the datamodule)."
            )
        steps = self.local_steps or local_steps
        if steps is None:
            raise TopologyError(
                "SiloTopology needs the local steps s per round: set local_steps on the "
                "strategy or on the topology."
            )
        model = DelayModel(self.model_size_bits or model_size_bits, self.compute_ms, steps)
        overlay = build_overlay(self.overlay_name, self.network, model)
        clock = MaxPlusClock(overlay.delays(self.network, model), overlay.steps_per_round)
        return overlay, clock
