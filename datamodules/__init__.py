"""Federated LightningDataModules and partitioners (installed as ``lightning_fl.datamodules``)."""

from lightning_fl.datamodules.base import (
    FederatedDataModule,
    FederatedLoader,
    InMemoryFederatedDataModule,
)
from lightning_fl.datamodules.digits import DigitsDataModule, load_digits
from lightning_fl.datamodules.flamby import (
    FedHeartDiseaseDataModule,
    FedTcgaBrcaDataModule,
    NaturalSplitDataModule,
)
from lightning_fl.datamodules.partition import (
    dirichlet_partition,
    iid_partition,
    shard_partition,
    split_fractions,
)

__all__ = [
    "DigitsDataModule",
    "FedHeartDiseaseDataModule",
    "FedTcgaBrcaDataModule",
    "NaturalSplitDataModule",
    "FederatedDataModule",
    "FederatedLoader",
    "InMemoryFederatedDataModule",
    "dirichlet_partition",
    "iid_partition",
    "load_digits",
    "shard_partition",
    "split_fractions",
]
