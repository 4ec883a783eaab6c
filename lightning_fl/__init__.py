"""lightning_fl: federated learning as a PyTorch Lightning strategy plus callbacks."""

from lightning_fl.asynchrony import (
    AsyncSchedule,
    ClientTimes,
    FedBuffSchedule,
    FedFixSchedule,
    SyncSchedule,
)
from lightning_fl.availability import AlwaysAvailable, MarkovAvailability, TwoClassAvailability
from lightning_fl.client_store import ClientStore
from lightning_fl.mixture import MixtureClassifier
from lightning_fl.models import (
    MLP,
    BinaryClassifier,
    CharLSTM,
    CifarCNN,
    Classifier,
    CoxRegression,
    DigitsCNN,
    FederatedTask,
    FemnistCNN,
    LeNet5,
    MnistCNN,
    MobileNetV2,
    ThreeConvCNN,
)
from lightning_fl.progress import FederatedProgressBar
from lightning_fl.samplers import (
    AvailableClients,
    ClientSampler,
    ClusteredSampler,
    ExcludedClients,
    FixedClustersSampler,
    FullParticipation,
    MDSampler,
    Participation,
    SampleSizeClusteredSampler,
    SimilarityClusteredSampler,
    UniformSampler,
)
from lightning_fl.strategy import FederatedStrategy, NonFiniteUpdateError
from lightning_fl.werm import WERMClassifier

__version__ = "0.1.0"

__all__ = [
    "AsyncSchedule",
    "ClientTimes",
    "FedBuffSchedule",
    "FedFixSchedule",
    "SyncSchedule",
    "TwoClassAvailability",
    "AlwaysAvailable",
    "AvailableClients",
    "MarkovAvailability",
    "MLP",
    "BinaryClassifier",
    "CharLSTM",
    "CifarCNN",
    "CoxRegression",
    "FederatedTask",
    "FemnistCNN",
    "Classifier",
    "ClientSampler",
    "ClusteredSampler",
    "ExcludedClients",
    "FixedClustersSampler",
    "ClientStore",
    "DigitsCNN",
    "FederatedProgressBar",
    "FederatedStrategy",
    "FullParticipation",
    "MDSampler",
    "MixtureClassifier",
    "LeNet5",
    "MnistCNN",
    "ThreeConvCNN",
    "MobileNetV2",
    "NonFiniteUpdateError",
    "Participation",
    "SampleSizeClusteredSampler",
    "SimilarityClusteredSampler",
    "UniformSampler",
    "WERMClassifier",
]
