"""lightning_fl: federated learning as a PyTorch Lightning strategy plus callbacks.

The tree shows the architecture (README, "How it works"):

- :mod:`lightning_fl.engine`: how a round happens. The Lightning-facing
  ``FederatedStrategy``, the round engine (who trains, their loaders, the client life
  cycle, the round's all-reduce), the round driver callback, checkpointed federated state,
  vectorized clients, per-client evaluation, and the plugin contract's helpers.
- :mod:`lightning_fl.systems`: the papers' mathematics, one module per system family
  (samplers, availability, CA-Fed, asynchrony, topology, FedEM mixtures, FEM-OMD,
  datastores, streams, unlearning, WERM, membership inference). No module here imports
  the engine's strategy.
- ``lightning_fl.callbacks`` and ``lightning_fl.datamodules``: the plugins that connect
  the two to a Trainer (installed from the repository's callbacks/ and datamodules/).
- :mod:`lightning_fl.models`: the tasks and networks of the recipes; :mod:`lightning_fl.cli`
  and :mod:`lightning_fl.sweep`: the command lines; :mod:`lightning_fl.plots`: figures.
"""

from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.federated_state import CheckpointReadError, FederationMismatchError
from lightning_fl.engine.outputs import quiet_console
from lightning_fl.engine.progress import FederatedProgressBar
from lightning_fl.engine.strategy import FederatedStrategy, NonFiniteUpdateError
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
    SifuFashionCNN,
)
from lightning_fl.systems.asynchrony import (
    AsyncSchedule,
    ClientTimes,
    FedBuffSchedule,
    FedFixSchedule,
    SyncSchedule,
)
from lightning_fl.systems.availability import (
    AlwaysAvailable,
    MarkovAvailability,
    TwoClassAvailability,
)
from lightning_fl.systems.mixture import MixtureClassifier
from lightning_fl.systems.samplers import (
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
from lightning_fl.systems.topology import SiloTopology
from lightning_fl.systems.werm import WERMClassifier

quiet_console()  # a script's console as the command line's (LIGHTNING_FL_VERBOSE=1: Lightning's)

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
    "CheckpointReadError",
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
    "FederationMismatchError",
    "FullParticipation",
    "MDSampler",
    "MixtureClassifier",
    "LeNet5",
    "MnistCNN",
    "MobileNetV2",
    "NonFiniteUpdateError",
    "Participation",
    "SampleSizeClusteredSampler",
    "SifuFashionCNN",
    "SimilarityClusteredSampler",
    "SiloTopology",
    "UniformSampler",
    "WERMClassifier",
]
