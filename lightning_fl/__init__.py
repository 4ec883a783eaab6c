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

from __future__ import annotations

import importlib

from lightning_fl.console import quiet_console

quiet_console()  # a script's console as the command line's (LIGHTNING_FL_VERBOSE=1: Lightning's)

__version__ = "0.1.0"

#: Each public name and the module that defines it, imported on first use: importing
#: ``lightning_fl`` alone (the console script's first step) imports neither torch nor
#: Lightning, so that ``lightning-fl --help`` and configuration errors answer at once.
_EXPORTS = {
    "AlwaysAvailable": "lightning_fl.systems.availability",
    "AsyncSchedule": "lightning_fl.systems.asynchrony",
    "AvailableClients": "lightning_fl.systems.samplers",
    "BinaryClassifier": "lightning_fl.models",
    "CharLSTM": "lightning_fl.models",
    "CheckpointReadError": "lightning_fl.engine.federated_state",
    "CifarCNN": "lightning_fl.models",
    "Classifier": "lightning_fl.models",
    "ClientSampler": "lightning_fl.systems.samplers",
    "ClientStore": "lightning_fl.engine.client_store",
    "ClientTimes": "lightning_fl.systems.asynchrony",
    "ClusteredSampler": "lightning_fl.systems.samplers",
    "CoxRegression": "lightning_fl.models",
    "DigitsCNN": "lightning_fl.models",
    "ExcludedClients": "lightning_fl.systems.samplers",
    "FedBuffSchedule": "lightning_fl.systems.asynchrony",
    "FedFixSchedule": "lightning_fl.systems.asynchrony",
    "FederatedProgressBar": "lightning_fl.engine.progress",
    "FederatedStrategy": "lightning_fl.engine.strategy",
    "FederatedTask": "lightning_fl.models",
    "FederationMismatchError": "lightning_fl.engine.federated_state",
    "FemnistCNN": "lightning_fl.models",
    "FixedClustersSampler": "lightning_fl.systems.samplers",
    "FullParticipation": "lightning_fl.systems.samplers",
    "LeNet5": "lightning_fl.models",
    "MDSampler": "lightning_fl.systems.samplers",
    "MLP": "lightning_fl.models",
    "MarkovAvailability": "lightning_fl.systems.availability",
    "MixtureClassifier": "lightning_fl.systems.mixture",
    "MnistCNN": "lightning_fl.models",
    "MobileNetV2": "lightning_fl.models",
    "NonFiniteUpdateError": "lightning_fl.engine.strategy",
    "Participation": "lightning_fl.systems.samplers",
    "PoissonSampler": "lightning_fl.systems.samplers",
    "SampleSizeClusteredSampler": "lightning_fl.systems.samplers",
    "SifuFashionCNN": "lightning_fl.models",
    "SiloTopology": "lightning_fl.systems.topology",
    "SojournMarkovAvailability": "lightning_fl.systems.availability",
    "SimilarityClusteredSampler": "lightning_fl.systems.samplers",
    "SyncSchedule": "lightning_fl.systems.asynchrony",
    "TwoClassAvailability": "lightning_fl.systems.availability",
    "UniformSampler": "lightning_fl.systems.samplers",
    "WERMClassifier": "lightning_fl.systems.werm",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_fl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
