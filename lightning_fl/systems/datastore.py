"""kNN-Per's per-client datastore of (representation, label) pairs (Marfoq et al., ICML
2022; Marfoq thesis §3.6, eqs. 3.29–3.32), searched with FAISS or torch brute force."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

UpdateRule = Literal["fifo", "concatenate", "fixed"]
Backend = Literal["faiss", "torch"]


def faiss_gpu_available() -> bool:
    """True when faiss-gpu is installed and sees a GPU."""
    try:
        import faiss
    except ImportError:
        return False
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class Datastore:
    """Keys (float32 representations) and their labels, with nearest-neighbour search.

    Args:
        backend: ``"faiss"`` (IndexFlatL2, or IndexIVFFlat with ``index="ivf"``; moved to
            the GPU automatically when faiss-gpu and a GPU are present) or ``"torch"``
            (exact brute force with ``torch.cdist``).
        index: ``"flat"`` (exact) or ``"ivf"`` (inverted lists, for large datastores;
            approximate, ``nlist`` cells of which ``nprobe`` are searched). IVF needs at
            least ``nlist`` keys; smaller stores fall back to the exact index.
        capacity: the most keys kept; ``None`` keeps all.
        update_rule: what :meth:`update` does with new pairs under distribution shift
            (§3.6.4, Fig. 3.13): ``"fifo"`` appends and drops the oldest beyond capacity,
            ``"concatenate"`` appends (the capacity grows), ``"fixed"`` ignores them.
    """

    def __init__(
        self,
        backend: Backend = "faiss",
        index: Literal["flat", "ivf"] = "flat",
        capacity: int | None = None,
        update_rule: UpdateRule = "fixed",
        nlist: int = 100,
        nprobe: int = 8,
    ) -> None:
        if backend not in ("faiss", "torch"):
            raise ValueError(f"backend must be 'faiss' or 'torch', got {backend!r}.")
        if index not in ("flat", "ivf"):
            raise ValueError(f"index must be 'flat' or 'ivf', got {index!r}.")
        if update_rule not in ("fifo", "concatenate", "fixed"):
            raise ValueError(
                f"update_rule must be 'fifo', 'concatenate' or 'fixed', got {update_rule!r}."
            )
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}.")
        self.backend, self.index_kind = backend, index
        self.capacity, self.update_rule = capacity, update_rule
        self.nlist, self.nprobe = nlist, nprobe
        # host: keys stay on the host (FAISS reads numpy; faiss-gpu copies its own index)
        self.keys, self.labels = torch.empty(0, 0), torch.empty(0, dtype=torch.long)
        self._index = None
        self._keep_alive: object = None

    def __len__(self) -> int:
        return len(self.labels)

    def build(self, keys: Tensor, labels: Tensor) -> Datastore:
        """Replace the content with ``keys`` (the last ``capacity`` of them)."""
        if keys.ndim != 2 or len(keys) != len(labels):
            raise ValueError(
                f"keys must be [N, d] with one label each, got {tuple(keys.shape)} keys and "
                f"{len(labels)} labels."
            )
        if self.capacity is not None:
            keys, labels = keys[-self.capacity :], labels[-self.capacity :]
        self.keys = keys.detach().float().cpu().contiguous()
        self.labels = labels.detach().long().cpu()
        self._index = None
        return self

    def update(self, keys: Tensor, labels: Tensor) -> None:
        """Add new pairs according to ``update_rule``."""
        if self.update_rule == "fixed" and len(self):
            return
        keys = keys.detach().float().cpu()
        if len(self):
            keys = torch.cat([self.keys, keys])
            labels = torch.cat([self.labels, labels.detach().long().cpu()])
        if self.update_rule == "concatenate":
            self.keys, self.labels, self._index = keys.contiguous(), labels.long(), None
        else:
            self.build(keys, labels)

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Euclidean distances [Q, k'] and labels [Q, k'] of the k' = min(k, N) nearest keys,
        nearest first. An IVF index searches only its ``nprobe`` nearest cells: a neighbour
        it could not find there comes back as key 0 at an infinite distance, so that its
        kNN weight is 0."""
        if not len(self):
            raise ValueError("The datastore is empty: build it from the client's data first.")
        k = min(k, len(self))
        queries = queries.detach().float()
        if self.backend == "torch":
            distances = torch.cdist(queries.cpu(), self.keys)
            values, idx = torch.topk(distances, k, dim=1, largest=False)
            return values, self.labels[idx]
        squared, idx = self._faiss_index().search(
            np.ascontiguousarray(queries.cpu().numpy(), dtype=np.float32), k
        )
        idx_t = torch.from_numpy(idx).long()  # host: FAISS answers in numpy, beside the keys
        distances = torch.from_numpy(squared).clamp_min(0).sqrt()  # host: FAISS answers in numpy
        missing = idx_t < 0  # IVF found fewer than k neighbours in the probed cells
        distances[missing] = float("inf")
        return distances, self.labels[idx_t.masked_fill(missing, 0)]

    def _faiss_index(self):
        if self._index is not None:
            return self._index
        try:
            import faiss
        except ImportError as err:
            raise ImportError(
                "The FAISS backend needs faiss: pip install 'lightning-fl[faiss]' (faiss-cpu) or "
                "faiss-gpu, or use backend='torch' (exact brute force)."
            ) from err

        keys = np.ascontiguousarray(self.keys.numpy(), dtype=np.float32)
        d = keys.shape[1]
        if self.index_kind == "ivf" and len(keys) >= self.nlist:
            quantizer = faiss.IndexFlatL2(d)
            index = faiss.IndexIVFFlat(quantizer, d, self.nlist)
            index.train(keys)
            index.nprobe = self.nprobe
            self._keep_alive = quantizer  # the IVF index does not own its quantizer
        else:
            index = faiss.IndexFlatL2(d)
        if faiss_gpu_available():
            resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(resources, 0, index)
            self._keep_alive = (self._keep_alive, resources)
        index.add(keys)
        self._index = index
        return index


def knn_probabilities(
    distances: Tensor, labels: Tensor, num_classes: int, scale: float = 1.0
) -> Tensor:
    """Eq. (3.32): [h^(k)(x)]_y ∝ Σ_i 1{y_(i) = y} exp(−d(z, z_(i))/σ), normalized over
    classes (a softmax over the k neighbours' −d/σ, scattered onto their labels)."""
    weights = torch.softmax(-distances / scale, dim=1)
    probs = torch.zeros(len(distances), num_classes, dtype=weights.dtype, device=weights.device)
    return probs.scatter_add_(1, labels, weights)
