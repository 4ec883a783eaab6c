"""Algorithms that plug into a federated round (installed as ``lightning_fl.callbacks``)."""

from lightning_fl.callbacks.aggregation import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi
from lightning_fl.callbacks.base import Aggregator, FederatedCallback, RoundState
from lightning_fl.callbacks.baselines import Local, Pooled
from lightning_fl.callbacks.fedem import FedEM
from lightning_fl.callbacks.fedprox import FedProx
from lightning_fl.callbacks.gossip import GossipAveraging
from lightning_fl.callbacks.knn_per import KNNPer
from lightning_fl.callbacks.scaffold import SCAFFOLD

__all__ = [
    "Aggregator",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedEM",
    "FedProx",
    "FedYogi",
    "FederatedCallback",
    "GossipAveraging",
    "KNNPer",
    "Local",
    "Pooled",
    "RoundState",
    "SCAFFOLD",
]
