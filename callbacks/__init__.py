"""Algorithms that plug into a federated round (installed as ``lightning_fl.callbacks``).

Every plugin is a :class:`FederatedCallback` (the contract, :mod:`lightning_fl.engine.plugins`:
round hooks and capability flags); exactly one is the :class:`Aggregator` that writes
θ^{t+1} (:class:`FedAvg` when a run names none). Read by family:

- aggregation: :mod:`.aggregation` (FedAvg and the server optimizers FedAvgM, FedAdam,
  FedYogi, FedAdagrad), :mod:`.fedprox`, :mod:`.scaffold`, :mod:`.baselines` (Local,
  Pooled), :mod:`.streams` (historical and fresh clients' weights, the cache discrepancy);
- personalization: :mod:`.personalized` (FedAvg+, Ditto, APFL, FedRep, pFedMe),
  :mod:`.fedem` (FedEM mixtures), :mod:`.knn_per` (kNN-Per datastores), :mod:`.clustered`
  (Clustered FL), :mod:`.gossip` (decentralized averaging over a topology);
- participation and time: :mod:`.asynchronous` (FedFix, FedBuff on a simulated clock),
  :mod:`.safari` (server-assisted FedAvg), :mod:`.objective` (the federated objective
  measured on the training data);
- privacy and robustness: :mod:`.privacy` (DP-SGD, membership inference, WERM's server
  reference), :mod:`.user_dp` (DP-FedAvg with adaptive clipping), :mod:`.secure_aggregation`
  (pairwise masks), :mod:`.robust`
  (median, trimmed mean, Krum, centered clipping), :mod:`.attacks` (sign flipping, scaled
  and Gaussian updates), :mod:`.unlearning` (SIFU and its baselines; the methods are
  :mod:`lightning_fl.systems.forgetting`), :mod:`.free_riders` (attacks and their detector);
- :mod:`.catalog`: the README's table of the main plugins, generated from them.

The papers' mathematics the plugins call lives in :mod:`lightning_fl.systems`; the plugins
connect it to a round. ``FederatedPlots`` (the run's figures) is :mod:`lightning_fl.plots`'.
"""

from lightning_fl.callbacks.aggregation import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi
from lightning_fl.callbacks.asynchronous import AsynchronousFL
from lightning_fl.callbacks.attacks import GaussianUpdates, ScaledUpdates, SignFlipping
from lightning_fl.callbacks.baselines import Local, Pooled
from lightning_fl.callbacks.clustered import ClusteredFL
from lightning_fl.callbacks.fedem import FedEM
from lightning_fl.callbacks.fedprox import FedProx
from lightning_fl.callbacks.free_riders import FreeRiderDetector, FreeRiders
from lightning_fl.callbacks.gossip import GossipAveraging
from lightning_fl.callbacks.knn_per import KNNPer
from lightning_fl.callbacks.objective import FederatedObjective
from lightning_fl.callbacks.personalized import APFL, Ditto, FedRep, FineTune, PFedMe
from lightning_fl.callbacks.privacy import DPSGD, MembershipInference, ServerReference
from lightning_fl.callbacks.robust import CenteredClipping, CoordinateMedian, Krum, TrimmedMean
from lightning_fl.callbacks.safari import SAFARI
from lightning_fl.callbacks.scaffold import SCAFFOLD
from lightning_fl.callbacks.secure_aggregation import SecureAggregation
from lightning_fl.callbacks.streams import CacheDiscrepancy, IterateAverage, StreamFedAvg
from lightning_fl.callbacks.unlearning import StopAtTarget, Unlearning
from lightning_fl.callbacks.user_dp import DPFedAvg
from lightning_fl.engine.plugins import Aggregator, FederatedCallback, RoundState
from lightning_fl.plots import FederatedPlots

#: The families above, by module (the API reference groups the plugins by them).
FAMILIES: dict[str, tuple[str, ...]] = {
    "Aggregation": ("aggregation", "fedprox", "scaffold", "baselines", "streams"),
    "Personalization": ("personalized", "fedem", "knn_per", "clustered", "gossip"),
    "Participation and time": ("asynchronous", "safari", "objective"),
    "Privacy and robustness": ("privacy", "user_dp", "secure_aggregation", "robust", "attacks",
                               "unlearning", "free_riders"),
}  # fmt: skip

__all__ = [
    "Aggregator",
    "APFL",
    "CacheDiscrepancy",
    "CenteredClipping",
    "CoordinateMedian",
    "DPFedAvg",
    "GaussianUpdates",
    "Krum",
    "ScaledUpdates",
    "SignFlipping",
    "TrimmedMean",
    "AsynchronousFL",
    "ClusteredFL",
    "Ditto",
    "DPSGD",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedEM",
    "FederatedObjective",
    "FederatedCallback",
    "FederatedPlots",
    "FedProx",
    "FedRep",
    "FedYogi",
    "FreeRiderDetector",
    "FreeRiders",
    "FineTune",
    "GossipAveraging",
    "IterateAverage",
    "KNNPer",
    "Local",
    "MembershipInference",
    "PFedMe",
    "Pooled",
    "RoundState",
    "SAFARI",
    "SCAFFOLD",
    "ServerReference",
    "StopAtTarget",
    "StreamFedAvg",
    "Unlearning",
    "SecureAggregation",
]
