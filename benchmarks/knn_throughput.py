"""kNN-Per evaluation throughput: queries per second of a client's datastore search plus
the kernel of eq. (3.32), FAISS (IndexFlatL2, and IVF) against torch brute force
(``torch.cdist`` + ``topk``), in the same process.

    python benchmarks/knn_throughput.py [--queries 1000] [--repeats 3]

Datastore sizes 1k, 10k, 100k; dimensions 128 and 1280 (kNN-Per's MobileNet-v2
representation); k = 10. Prints a Markdown table and the FAISS/torch speed ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_fl.systems.datastore import Datastore, knn_probabilities


def queries_per_second(store: Datastore, queries: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        distances, labels = store.search(queries, 10)
        knn_probabilities(distances, labels, 10)
        times.append(time.perf_counter() - start)
    return len(queries) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 1280])
    args = parser.parse_args()
    print(
        f"threads {torch.get_num_threads()}, {args.queries} queries, k=10, median of {args.repeats}"
    )
    print(
        "| size | dim | torch q/s | faiss flat q/s | faiss ivf q/s | flat/torch | ivf recall@10 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for dim in args.dims:
        for size in args.sizes:
            keys = torch.randn(size, dim, generator=g)
            labels = torch.randint(0, 10, (size,), generator=g)
            queries = torch.randn(args.queries, dim, generator=g)
            brute = Datastore(backend="torch").build(keys, labels)
            flat = Datastore(backend="faiss").build(keys, labels)
            ivf = Datastore(backend="faiss", index="ivf", nlist=max(1, int(size**0.5)), nprobe=8)
            ivf.build(keys, labels)
            for store in (flat, ivf):
                store.search(queries[:1], 10)  # build the index outside the timing
            q_torch = queries_per_second(brute, queries, args.repeats)
            q_flat = queries_per_second(flat, queries, args.repeats)
            q_ivf = queries_per_second(ivf, queries, args.repeats)
            exact = torch.cdist(queries, keys).topk(10, largest=False).indices
            approx = torch.from_numpy(ivf._faiss_index().search(queries.numpy(), 10)[1])
            recall = (
                sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact))
                / exact.numel()
            )
            print(
                f"| {size:,} | {dim} | {q_torch:,.0f} | {q_flat:,.0f} | {q_ivf:,.0f} | "
                f"{q_flat / q_torch:.2f} | {recall:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
