"""Federated LightningDataModules and partitioners (installed as ``lightning_fl.datamodules``).

A :class:`FederatedDataModule` gives each client's datasets by split (``client_dataset``),
the clients' sample counts and the loaders the strategy expands into rounds
(the contract: :mod:`lightning_fl.engine.data_contract`; clients held as tensors:
:mod:`.in_memory`). Constructors store and validate their arguments; data is downloaded in
``prepare_data`` and read in ``setup`` (or at its first use). By source:

- :mod:`.digits`: the embedded UCI digits (no download), the quickstart's;
- :mod:`.fashion_mnist`, :mod:`.emnist`, :mod:`.cifar`: image datasets split over clients
  by the partitions of :mod:`.partition` (Dirichlet, shards, pachinko, one class, SIFU's);
- :mod:`.leaf`: LEAF's natural per-user splits (FEMNIST, Shakespeare, Sent140, CelebA);
- :mod:`.flamby`: FLamby's natural per-center splits (Fed-Heart-Disease, Fed-TCGA-BRCA)
  and any table with a center column;
- :mod:`.synthetic`: FedEM's synthetic mixture; :mod:`.streaming`: data streams with cache
  rules over any datamodule, and P1's logistic streams;
- :mod:`.privacy` and :mod:`.reference`: clients with reference data (WERM, membership
  inference: Purchase100, Texas100, their CPU variants);
- :mod:`.arrays`: federations as arrays with per-client offsets, in memory or
  memory-mapped on disk (10⁵–10⁶ clients); :mod:`.population`: generated LEAF-shaped
  populations and LEAF's JSON converted into that format;
- :mod:`.download`: checked downloads (SHA-256 or MD5).
"""

from lightning_fl.datamodules.arrays import (
    ArrayFederatedDataModule,
    ClientArrays,
    FederationFormatError,
    open_federation,
    save_federation,
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
from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.leaf import (
    GeneratedLeafDataModule,
    LeafDataModule,
    generate_synthetic,
    read_leaf_file,
    write_leaf_json,
)
from lightning_fl.datamodules.leaf_convert import LeafEncoding, convert_leaf
from lightning_fl.datamodules.partition import (
    dirichlet_partition,
    grouped_dirichlet_partition,
    iid_partition,
    pachinko_partition,
    shard_partition,
    split_fractions,
)
from lightning_fl.datamodules.population import (
    GeneratedPopulationDataModule,
    generate_population,
    population_counts,
    write_leaf_population,
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
from lightning_fl.engine.data_contract import FederatedDataModule, FederatedLoader

__all__ = [
    "ArrayFederatedDataModule",
    "ClientArrays",
    "FederationFormatError",
    "open_federation",
    "save_federation",
    "GeneratedPopulationDataModule",
    "convert_leaf",
    "LeafEncoding",
    "generate_population",
    "population_counts",
    "write_leaf_population",
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
