"""Algorithms that plug into a federated round (installed as ``lightning_fl.callbacks``)."""

from lightning_fl.callbacks.aggregation import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi
from lightning_fl.callbacks.asynchronous import AsynchronousFL
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
from lightning_fl.callbacks.safari import SAFARI
from lightning_fl.callbacks.scaffold import SCAFFOLD
from lightning_fl.callbacks.streams import CacheDiscrepancy, IterateAverage, StreamFedAvg
from lightning_fl.callbacks.unlearning import StopAtTarget, Unlearning
from lightning_fl.engine.plugins import Aggregator, FederatedCallback, RoundState
from lightning_fl.plots import FederatedPlots

__all__ = [
    "Aggregator",
    "APFL",
    "CacheDiscrepancy",
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
]
