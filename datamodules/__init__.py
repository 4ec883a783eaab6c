"""Federated LightningDataModules and partitioners (installed as ``lightning_fl.datamodules``)."""

from lightning_fl.datamodules.base import (
    FederatedDataModule,
    FederatedLoader,
    InMemoryFederatedDataModule,
)
from lightning_fl.datamodules.cifar import CifarDataModule, load_pickle_batch
from lightning_fl.datamodules.digits import DigitsDataModule, load_digits
from lightning_fl.datamodules.emnist import EmnistDataModule, read_emnist, read_idx
from lightning_fl.datamodules.fashion_mnist import FashionMnistDataModule, read_fashion_mnist
from lightning_fl.datamodules.flamby import (
    FedHeartDiseaseDataModule,
    FedTcgaBrcaDataModule,
    NaturalSplitDataModule,
)
from lightning_fl.datamodules.leaf import (
    GeneratedLeafDataModule,
    LeafDataModule,
    generate_synthetic,
    read_leaf_file,
    write_leaf_json,
)
from lightning_fl.datamodules.partition import (
    dirichlet_partition,
    grouped_dirichlet_partition,
    iid_partition,
    pachinko_partition,
    shard_partition,
    split_fractions,
)
from lightning_fl.datamodules.privacy import (
    DigitsReferenceDataModule,
    Purchase100DataModule,
    ReferenceDataModule,
    SyntheticPurchaseDataModule,
    Texas100DataModule,
    generate_purchase_like,
    load_purchase100,
    load_texas100,
)
from lightning_fl.datamodules.reference import PairedLoader, WERMDataset, paired_loader
from lightning_fl.datamodules.streaming import LogisticStreamsDataModule, StreamingDataModule
from lightning_fl.datamodules.synthetic import SyntheticMixtureDataModule, generate_mixture_tasks

__all__ = [
    "LogisticStreamsDataModule",
    "StreamingDataModule",
    "EmnistDataModule",
    "FashionMnistDataModule",
    "read_fashion_mnist",
    "read_emnist",
    "read_idx",
    "SyntheticPurchaseDataModule",
    "generate_purchase_like",
    "DigitsReferenceDataModule",
    "PairedLoader",
    "Purchase100DataModule",
    "ReferenceDataModule",
    "Texas100DataModule",
    "WERMDataset",
    "load_purchase100",
    "load_texas100",
    "paired_loader",
    "SyntheticMixtureDataModule",
    "generate_mixture_tasks",
    "CifarDataModule",
    "DigitsDataModule",
    "FedHeartDiseaseDataModule",
    "FedTcgaBrcaDataModule",
    "NaturalSplitDataModule",
    "FederatedDataModule",
    "FederatedLoader",
    "GeneratedLeafDataModule",
    "LeafDataModule",
    "InMemoryFederatedDataModule",
    "dirichlet_partition",
    "generate_synthetic",
    "read_leaf_file",
    "write_leaf_json",
    "grouped_dirichlet_partition",
    "pachinko_partition",
    "iid_partition",
    "load_digits",
    "load_pickle_batch",
    "shard_partition",
    "split_fractions",
]
