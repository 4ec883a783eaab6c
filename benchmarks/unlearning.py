"""Sequential federated unlearning (Fraboni et al. AISTATS 2024; thesis ch. 5, Fig. 5.2) on
the embedded digits, with the protocol of recipes/robustness/digits_sifu.yaml, or on
Fashion-MNIST with recipes/fashion_mnist/sifu.yaml (Tab. D.1's FashionMNIST row and the
authors' CNN and settings).

    python benchmarks/unlearning.py [--seeds 0 1 2] [--target 0.93]
    python benchmarks/unlearning.py --dataset fashion_mnist [--seeds 0 1 2] [--methods sifu
        scratch] [--max-rounds 3000] [--accelerator gpu]

Every finished protocol run is appended to benchmarks/results/unlearning_<dataset>.jsonl
and skipped when the script runs again, so a long Fashion-MNIST sweep can be stopped and
resumed (or run on a GPU machine) and its table rebuilt from what has finished. A run in
progress is saved every PROGRESS_EVERY rounds under outputs/unlearning/ (one checkpoint
per run, named by its method, seed and journal key), and the next invocation resumes it
from there: a stopped 10^4-round phase loses at most PROGRESS_EVERY − 1 rounds, and the
resumed run ends where the uninterrupted one would (tests/test_late_paths.py). As in the
authors' code, SIFU, SCRATCH, FINE-TUNING and LAST share the training before the first
request: it runs once per seed and σ, is saved under outputs/unlearning/ (kept between
invocations), and each of the four methods resumes from it (the resumed protocol equals
the uninterrupted one: tests/test_unlearning.py checks it on a small federation).

100 clients holding one digit each, logistic regression, Tab. D.1's MNIST row. Train to
the target training accuracy of the remaining clients (at least 50 rounds), then forget
digit 0, retrain to the target, forget digit 1, then digit 2; for SIFU and the baselines
SCRATCH, FINE-TUNING, LAST, DP and FEDACCUM. Reports, per request, the retraining rounds
and the accuracy on the forgotten clients' training data when the target is reached again
(mean over seeds). Then the σ sweep of Fig. D.2 for one request. The thesis publishes
curves only; the claim checked is SIFU ≈ SCRATCH on the forgotten clients in fewer rounds,
with FINE-TUNING, FEDACCUM and DP keeping a higher accuracy on them. Writes
benchmarks/results/unlearning.md.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import statistics
from pathlib import Path

import torch
import yaml
from recipe_runs import callback_of, run_recipe
from run_times import machine

from lightning_fl.systems.forgetting import SHARED_TRAINING

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "digits": ROOT / "recipes" / "robustness" / "digits_sifu.yaml",
    "fashion_mnist": ROOT / "recipes" / "fashion_mnist" / "sifu.yaml",
}
TARGETS = {"digits": 0.93, "fashion_mnist": 0.90}  # App. D.4's stopping accuracies
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ["scratch", "sifu", "fine_tuning", "fedaccum", "dp", "last"]


#: rounds a phase at most: digits's earlier table used 400; the authors' T for Fashion-MNIST
CAPS = {"digits": 400, "fashion_mnist": 10_000}
MAX_ROUNDS = CAPS["digits"]
RECIPE, ACCELERATOR = RECIPES["digits"], "cpu"
SHARED = ROOT / "outputs" / "unlearning"
#: the methods whose model before the first request is plain FedAvg's: SHARED_TRAINING's,
#: and FEDACCUM's, which trains its own first phase (its shadows are recorded from round
#: one) along the same trajectory; their rounds to the target agree on one machine
PLAIN_FIRST_PHASE = SHARED_TRAINING | {"fedaccum"}
#: rounds between the saves of a run in progress (under SHARED), from which a stopped run
#: resumes: a Fashion-MNIST phase may take 10^4 rounds, hours on a CPU
PROGRESS_EVERY = 200
#: σ of Fig. D.2's sweep: digits's earlier table; Fashion-MNIST, the authors' code's
#: {1, 2, 5} × 10^-k, k = 0..4 (one request, P70)
SWEEPS = {
    "digits": (0.0005, 0.005, 0.01, 0.02, 0.03, 0.05, 0.5, 5.0),
    "fashion_mnist": tuple(m * 10.0**-k for k in range(4, -1, -1) for m in (1, 2, 5)),
}


def use_dataset(
    dataset: str,
    accelerator: str = "cpu",
    max_rounds: int | None = None,
    save_every: int | None = None,
) -> None:
    """Run the protocol on ``dataset``'s recipe, with a phase cap of ``max_rounds`` (default:
    the dataset's), saving a run in progress every ``save_every`` rounds (default:
    PROGRESS_EVERY's value)."""
    global RECIPE, ACCELERATOR, MAX_ROUNDS, PROGRESS_EVERY
    RECIPE, ACCELERATOR = RECIPES[dataset], accelerator
    MAX_ROUNDS = max_rounds or CAPS[dataset]
    PROGRESS_EVERY = save_every or PROGRESS_EVERY


def recipe_edit(method: str, seed: int, target: float, sigma: float, requests=None):
    """The recipe's edit for one protocol run: ``edit(config, method, extra_callbacks)``."""

    def edit(config, method=method, extra_callbacks=()):
        config["trainer"]["accelerator"] = ACCELERATOR
        config["trainer"]["max_epochs"] = 4 * MAX_ROUNDS
        unlearning = next(c for c in config["trainer"]["callbacks"]
                          if c["class_path"].endswith(".Unlearning"))["init_args"]  # fmt: skip
        unlearning.update(method=method, sigma=sigma, seed=seed)
        if requests is not None:
            unlearning["requests"] = requests
        unlearning["on_target"]["init_args"].update(target=target, max_rounds=MAX_ROUNDS)
        config["trainer"]["callbacks"] += list(extra_callbacks)

    return edit


def run_key(method: str, seed: int, target: float, sigma: float, requests) -> str:
    """What decides a protocol run's result: its method, seed, target, σ, requests, the
    phase cap and the recipe's settings (the journal's key)."""
    return json.dumps([method, seed, target, sigma, requests, MAX_ROUNDS, recipe_hash()])


def progress_path(key: str) -> Path:
    """Where the run of ``key`` is saved while in progress (every PROGRESS_EVERY rounds)."""
    method, seed = json.loads(key)[:2]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return SHARED / f"{RECIPE.stem}-{method}-seed{seed}-{digest}.progress.ckpt"


def saving_progress(path: Path) -> dict:
    """The recipe callback that saves a run to ``path`` every PROGRESS_EVERY rounds."""
    show = ["unlearning/remaining_train_acc", "unlearning/branch"]
    return {"class_path": "recipe_runs.ProgressCheckpoint",
            "init_args": {"path": str(path), "every": PROGRESS_EVERY, "show": show}}  # fmt: skip


def protocol(method: str, seed: int, target: float, sigma: float = 0.05, requests=None):
    """Run the protocol, from its last save if a stopped run left one (its rounds before
    the save are not trained again); the save is deleted when the run has finished."""
    edit = recipe_edit(method, seed, target, sigma, requests)
    progress = progress_path(run_key(method, seed, target, sigma, requests))
    args = []
    if progress.exists():
        print(f"resuming {progress.name}", flush=True)
        args = ["--ckpt_path", str(progress)]
    elif method in SHARED_TRAINING and requests is None:
        args = ["--ckpt_path", str(shared_training(seed, target, sigma, edit))]
    SHARED.mkdir(parents=True, exist_ok=True)
    save = saving_progress(progress)
    cli, _ = run_recipe(RECIPE, lambda config: edit(config, method, [save]), seed, args)
    unlearning = callback_of(cli, "Unlearning")
    forgotten = unlearning.phase_forgotten_acc[1:]  # kept in the checkpoints
    restarts = [[r["branch"], r["restart_round"]] for r in unlearning.done_requests]
    progress.unlink(missing_ok=True)
    return unlearning.phase_rounds, forgotten, restarts


def shared_training(seed: int, target: float, sigma: float, edit) -> Path:
    """The checkpoint at the end of the training before the first request, shared by the
    methods of SHARED_TRAINING; made once (by SIFU) per recipe, seed, target, σ and cap."""
    name = (
        f"{RECIPE.stem}-{recipe_hash()}-seed{seed}-target{target}-sigma{sigma}-cap{MAX_ROUNDS}.ckpt"
    )
    path = SHARED / name
    if not path.exists():
        SHARED.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        progress = path.with_suffix(".progress.ckpt")
        stop = {"class_path": "recipe_runs.PhaseCheckpoint", "init_args": {"path": str(partial)}}
        save = saving_progress(progress)
        args = ["--ckpt_path", str(progress)] if progress.exists() else []
        run_recipe(RECIPE, lambda config: edit(config, "sifu", [stop, save]), seed, args)
        partial.rename(path)
        progress.unlink(missing_ok=True)
    return path


@functools.cache
def _settings_hash(recipe: Path) -> str:
    settings = json.dumps(yaml.safe_load(recipe.read_text()), sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:10]


def recipe_hash() -> str:
    """The recipe's settings (not its comments), hashed (read once per recipe)."""
    return _settings_hash(RECIPE)


class Journal:
    """Finished protocol runs, one JSON line each, keyed by (method, seed, target, σ,
    requests, the phase cap, the recipe's hash)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                self.done[entry["key"]] = entry

    def protocol(
        self, method: str, seed: int, target: float, sigma: float = 0.05, requests=None,
        run: bool = True,
    ):  # fmt: skip
        """The run's (phase rounds, forgotten accuracies, restart nodes [branch, round] of
        its requests: None in entries journaled before they were), run now unless ``run``
        is False (then None when it has not finished yet)."""
        key = run_key(method, seed, target, sigma, requests)
        if key not in self.done and not run:
            return None
        if key not in self.done:
            rounds, forgotten, restarts = protocol(method, seed, target, sigma, requests)
            entry = {"key": key, "rounds": rounds, "forgotten": forgotten, "restarts": restarts,
                     "machine": machine_name()}  # fmt: skip
            with open(self.path, "a") as handle:
                handle.write(json.dumps(entry) + "\n")
            self.done[key] = entry
            print(method, seed, sigma, rounds, forgotten, flush=True)
        entry = self.done[key]
        return entry["rounds"], entry["forgotten"], entry.get("restarts")

    def seeds(self, target: float, sigma: float | None, requests=None) -> set[int]:
        """The seeds of the finished runs at ``target`` and ``sigma`` (None: any σ) with
        ``requests``, under the current phase cap and recipe."""
        found = set()
        for key in self.done:
            _, seed, t, s, r, cap, settings = json.loads(key)
            if (t, r, cap, settings) == (target, requests, MAX_ROUNDS, recipe_hash()) and (
                sigma is None or s == sigma
            ):
                found.add(seed)
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=list(RECIPES), default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, help="default: App. D.4's, per dataset")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--max-rounds", type=int, help="a phase's cap; default: per dataset")
    parser.add_argument("--no-sweep", action="store_true", help="skip the σ sweep")
    parser.add_argument("--sigmas", type=float, nargs="+",
                        help="the sweep's σ values to run now, in this order (default: all of "
                             "the dataset's); the table lists every finished one")  # fmt: skip
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--save-every", type=int, default=PROGRESS_EVERY,
                        help="rounds between the saves of a run in progress, from which a "
                        "stopped run resumes (more on a GPU, where a round is fast)")  # fmt: skip
    parser.add_argument("--table-only", action="store_true",
                        help="the table of the journal's finished runs; run nothing")  # fmt: skip
    args = parser.parse_args()
    if args.save_every < 1:
        parser.error(f"--save-every must be >= 1 (rounds), got {args.save_every}")
    use_dataset(args.dataset, args.accelerator, args.max_rounds, args.save_every)
    args.target = args.target or TARGETS[args.dataset]
    suffix = "" if args.dataset == "digits" else f"_{args.dataset}"
    journal = Journal(RESULTS / f"unlearning{suffix}.jsonl")
    torch.set_num_threads(1)
    setting = ("digits (100 one-digit clients, logistic regression)" if args.dataset == "digits"
               else "Fashion-MNIST (100 one-class clients, the SIFU authors' CNN)")  # fmt: skip
    sigma = sigma_main = 0.05 if args.dataset == "digits" else 0.1  # Tab. D.1
    # the table lists every seed the journal finished a run of, not only those run now
    seeds = sorted(set(args.seeds) | journal.seeds(args.target, sigma))
    plateau = "; digits plateaus near 0.95 in this one-class split" if suffix == "" else ""
    lines = [f"# Sequential unlearning on {setting}", "",
             f"`python benchmarks/unlearning.py --dataset {args.dataset}`: target training "
             f"accuracy {args.target} on the remaining clients (App. D.4's stopping accuracy"
             f"{plateau}), σ = {sigma}, ε = 10, δ = 0.01, seeds {seeds} "
             "(the thesis uses 10). Requests: class 0, then 1, then 2 (10 clients each). "
             f"Rounds = retraining rounds to reach the target again (capped at {MAX_ROUNDS}: "
             f"a mean that includes a capped phase is marked ≥); forgotten acc = "
             "accuracy on the training data of all clients forgotten so far, at that point "
             "(lower is better, SCRATCH is the reference).", "",
             "| method | initial rounds | rounds after W1 / W2 / W3 | total retraining | "
             "forgotten acc after W1 / W2 / W3 |", "|---|---|---|---|---|"]  # fmt: skip
    figure: dict[str, tuple[list[float], list[float], list[bool]]] = {}
    first_rounds: dict[int, dict[str, int]] = {seed: {} for seed in seeds}
    for seed in args.seeds:  # seed by seed, so that a stopped sweep has whole seeds
        for method in args.methods:
            journal.protocol(method, seed, args.target, sigma, run=not args.table_only)
    for method in METHODS:  # every method's row, whichever ran now
        runs = [journal.protocol(method, seed, args.target, sigma, run=False) for seed in seeds]
        finished = [r for r in runs if r is not None]
        name = method_name(method)
        unfinished = [seed for seed, run in zip(seeds, runs) if run is None]
        saved = saved_mid_run(method, unfinished, args.target, sigma)
        if not finished and not saved:
            lines.append(f"| {name} | not run yet | | | |")
        if finished:
            if len(finished) < len(seeds):
                name += f" ({len(finished)} of {len(seeds)} seeds)"
            row, figure[name] = method_row(name, [r[:2] for r in finished], MAX_ROUNDS)
            lines.append(row)
        lines += [saved_row(method, seed, path, MAX_ROUNDS) for seed, path in saved]
        for seed, run in zip(seeds, runs):
            if run is not None:
                first_rounds[seed][method] = run[0][0]
        for seed, path in saved:
            if (rounds := saved_first_phase(path)) is not None:
                first_rounds[seed][method] = rounds
    if mismatches := first_phase_mismatches(first_rounds):
        lines += ["", "Rounds before the first request where the methods of one seed differ: "
                  + "; ".join(mismatches) + ". The same computation, run on different "
                  "machines (journal lines name theirs under `machine`, since 2026-12-01): "
                  "float round-off moves the round the target is first met, so these "
                  "methods' requests start from different models. On one machine reruns "
                  "agree to the round."]  # fmt: skip
    if figure:
        plot = RESULTS / f"unlearning{suffix}.png"
        _plot(figure, plot, MAX_ROUNDS)
        lines += ["", f"![retraining rounds and forgotten-class accuracy per request]({plot.name})"]
    digit_0 = [[c for c in range(0, 100, 10)]]
    swept = journal.seeds(args.target, None, digit_0)
    running = not (args.table_only or args.no_sweep)
    # the sweep runs on the first seed given; the table shows the seed it has run on
    keep = running or args.seeds[0] in swept or not swept
    sweep_seed = args.seeds[0] if keep else min(swept)
    lines += ["", f"## σ sweep (Fig. D.2): SIFU, one request (class 0), seed {sweep_seed}", "",
              "| σ | Ψ* | restarts from θ^T, T of the rounds before the request | "
              "retraining rounds | forgotten acc |", "|---|---|---|---|---|"]  # fmt: skip
    from lightning_fl.systems.unlearning import sensitivity_threshold

    sweep = SWEEPS[args.dataset]
    unknown = sorted(set(args.sigmas or ()) - set(sweep))
    if unknown:
        parser.error(f"--sigmas {unknown} are not in the sweep {list(sweep)}: pick from it")
    chosen = args.sigmas or sweep if running else ()
    for sigma in chosen:  # in the given order, so that a stopped sweep keeps its spread
        journal.protocol("sifu", sweep_seed, args.target, sigma, digit_0)
    finished: list[tuple[float, int, float]] = []
    for sigma in sweep:
        run = journal.protocol("sifu", sweep_seed, args.target, sigma, digit_0, run=False)
        threshold = sensitivity_threshold(10, 0.01, sigma)
        if run is None:
            cell = unfinished_cell("sifu", [sweep_seed], args.target, sigma, digit_0)
            lines.append(f"| {sigma:g} | {threshold:.4g} | | {cell} | |")
            continue
        rounds, forgotten, restarts = run
        restart = "" if restarts is None else f"{restarts[0][1]} of {rounds[0]}"
        cap = "≥" if rounds[1] >= MAX_ROUNDS else ""
        lines.append(f"| {sigma:g} | {threshold:.4g} | {restart} | {cap}{rounds[1]} | "
                     f"{forgotten[0]:.3f} |")  # fmt: skip
        finished.append((sigma, rounds[1], forgotten[0]))
    if finished:
        scratch = journal.protocol("scratch", sweep_seed, args.target, sigma_main, run=False)
        plot = RESULTS / f"unlearning{suffix}_sigma.png"
        _plot_sweep(finished, None if scratch is None else scratch[0][1], plot, MAX_ROUNDS)
        lines += ["", f"![retraining rounds and forgotten-class accuracy against σ]({plot.name})"]
    _write(RESULTS / f"unlearning{suffix}.md", lines)


def method_name(method: str) -> str:
    """A method as the thesis names it in tables (fine_tuning: FINE-TUNING)."""
    return method.upper().replace("_", "-")


def saved_mid_run(
    method: str, seeds: list[int], target: float, sigma: float, requests=None
) -> list[tuple[int, Path]]:
    """The seeds whose run is saved mid-run under SHARED (the next invocation resumes
    them), each with its save."""
    paths = [
        (seed, progress_path(run_key(method, seed, target, sigma, requests))) for seed in seeds
    ]
    return [(seed, path) for seed, path in paths if path.exists()]


def unfinished_cell(
    method: str, seeds: list[int], target: float, sigma: float, requests=None
) -> str:
    """The cell of a run no seed has finished: the seeds saved mid-run, else "not run
    yet"."""
    saved = [seed for seed, _ in saved_mid_run(method, seeds, target, sigma, requests)]
    if not saved:
        return "not run yet"
    return f"unfinished: seed{'s' * (len(saved) > 1)} {', '.join(map(str, saved))} saved mid-run"


def machine_name() -> str:
    """The machine a run's numbers come from, journaled with them: float round-off differs
    between CPUs (and GPUs), and moves the round a phase first meets the target."""
    if ACCELERATOR != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return machine()


def first_phase_mismatches(first_rounds: dict[int, dict[str, int]]) -> list[str]:
    """The seeds whose methods of PLAIN_FIRST_PHASE took different rounds to the target
    before the first request (``first_rounds``: seed -> method -> rounds), each as
    ``seed 0: 859 (FINE-TUNING, FEDACCUM), 870 (SCRATCH)``: the same computation, so a
    difference means the runs came from different machines, and their requests started
    from different models."""
    lines = []
    for seed, by_method in sorted(first_rounds.items()):
        groups: dict[int, list[str]] = {}
        for method, rounds in by_method.items():
            if method in PLAIN_FIRST_PHASE:
                groups.setdefault(rounds, []).append(method_name(method))
        if len(groups) > 1:
            parts = [f"{r} ({', '.join(names)})" for r, names in sorted(groups.items())]
            lines.append(f"seed {seed}: " + ", ".join(parts))
    return lines


def read_save(path: Path) -> dict:
    """The save of a run in progress at ``path``, read with ``weights_only``: once per
    version of the file (its modification time), as the table reads each save twice (its
    row and its first phase) and a save takes seconds to read."""
    return _read_save(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_save(path: Path, version: int) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu", mmap=True)


def saved_first_phase(path: Path) -> int | None:
    """The rounds before the first request of the run saved at ``path`` (None while it is
    still in that phase)."""
    save = read_save(path)
    rounds = save["callbacks"]["Unlearning"]["phase_rounds"]
    return rounds[0] if rounds else None


def saved_row(method: str, seed: int, path: Path, cap: int) -> str:
    """The table row of a run saved mid-run at ``path`` (its progress checkpoint, read with
    ``weights_only``): the phases it has finished, from the Unlearning callback's record,
    and the round the current phase has reached (— for the phases after it); a phase at
    ``cap`` is marked ≥."""
    save = read_save(path)
    state = save["callbacks"]["Unlearning"]
    rounds, forgotten = state["phase_rounds"], state["phase_forgotten_acc"]
    cells = [("≥" if r >= cap else "") + str(r) for r in rounds]
    cells.append(f"at round {save['epoch'] + 1 - state['phase_start']}")
    cells += ["—"] * (4 - len(cells))
    accuracies = [f"{a:.3f}" for a in forgotten[1:]] + ["—"] * (4 - len(forgotten))
    name = f"{method_name(method)}, seed {seed} (unfinished, saved mid-run)"
    return (f"| {name} | {cells[0]} | " + " / ".join(cells[1:4]) + " | | "
            + " / ".join(accuracies[:3]) + " |")  # fmt: skip


def method_row(
    name: str, runs: list[tuple[list[int], list[float]]], cap: int
) -> tuple[str, tuple[list[float], list[float], list[bool]]]:
    """A method's table row and figure entry from its seeds' runs, each (rounds of the four
    phases, accuracy on the forgotten clients after W1..W3): per-phase means over seeds,
    a phase marked ≥ (and hatched) when any seed ran it to ``cap``."""
    rounds = [statistics.mean(r[0][k] for r in runs) for k in range(4)]
    capped = [any(r[0][k] >= cap for r in runs) for k in range(4)]
    cells = [("≥" if c else "") + f"{x:.0f}" for x, c in zip(rounds, capped)]
    forgotten = [statistics.mean(r[1][k] for r in runs) for k in range(3)]
    total = ("≥" if any(capped[1:]) else "") + f"{sum(rounds[1:]):.0f}"
    row = (f"| {name} | {cells[0]} | " + " / ".join(cells[1:]) + f" | {total} | "
           + " / ".join(f"{x:.3f}" for x in forgotten) + " |")  # fmt: skip
    return row, (rounds[1:], forgotten, capped[1:])


def _plot(
    figure: dict[str, tuple[list[float], list[float], list[bool]]], path: Path, cap: int
) -> None:
    """Fig. 5.2's two readings per request W1..W3: the retraining rounds to reach the
    target again, and the accuracy on the forgotten clients' training data then. A phase
    that ran to the cap (LAST's, in the thesis) is hatched and puts the rounds on a log
    scale, so that 10⁴ rounds and FINE-TUNING's 50 stay readable side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rounds_ax, forgotten_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(figure)
    for k, (name, (rounds, forgotten, capped)) in enumerate(figure.items()):
        where = [r + (k - (len(figure) - 1) / 2) * width for r in range(3)]
        bars = rounds_ax.bar(where, rounds, width, label=name)
        color = bars.patches[0].get_facecolor()
        forgotten_bars = forgotten_ax.bar(where, forgotten, width, color=color)
        for rounds_bar, forgotten_bar, at_cap in zip(bars, forgotten_bars, capped):
            if at_cap:
                rounds_bar.set_hatch("//")
                forgotten_bar.set_hatch("//")
    any_capped = any(any(capped) for _, _, capped in figure.values())
    rounds_label = f"retraining rounds (cap {cap}" + ("; hatched: at the cap)" if any_capped
                                                      else ")")  # fmt: skip
    if any_capped:
        rounds_ax.set_yscale("log")
    for ax, label in ((rounds_ax, rounds_label),
                      (forgotten_ax, "accuracy on the forgotten clients")):  # fmt: skip
        ax.set_xticks(range(3), ["W1", "W2", "W3"])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    forgotten_ax.set_ylim(0, 1)
    forgotten_ax.legend(*rounds_ax.get_legend_handles_labels(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(
    finished: list[tuple[float, int, float]], scratch: int | None, path: Path, cap: int
) -> None:
    """Fig. D.2's two readings against σ (log scale): SIFU's retraining rounds after the
    request, beside SCRATCH's on the same seed, and the accuracy on the forgotten clients.
    A σ whose retraining ran to the cap (LAST's behaviour, at large σ) is drawn as an open
    marker in both panels and puts the rounds on a log scale, as in :func:`_plot`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sigmas, rounds, forgotten = zip(*finished)
    fig, (rounds_ax, forgotten_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    rounds_ax.plot(sigmas, rounds, "o-", label="SIFU")
    if scratch is not None:
        rounds_ax.axhline(scratch, color="gray", linestyle="--", label="SCRATCH (same seed)")
    forgotten_ax.plot(sigmas, forgotten, "o-", label="SIFU")
    at_cap = [k for k, r in enumerate(rounds) if r >= cap]
    rounds_label = f"retraining rounds (cap {cap})"
    if at_cap:
        for ax, values in ((rounds_ax, rounds), (forgotten_ax, forgotten)):
            ax.plot([sigmas[k] for k in at_cap], [values[k] for k in at_cap], "o",
                    markerfacecolor="white", color="C0", label="at the cap")  # fmt: skip
        rounds_ax.set_yscale("log")
        rounds_label = f"retraining rounds (cap {cap}; open: at the cap)"
    for ax, label in ((rounds_ax, rounds_label),
                      (forgotten_ax, "accuracy on the forgotten clients")):  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("σ")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    forgotten_ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(path: Path, lines: list[str]) -> None:
    from recipe_runs import write_keeping_reading

    print(write_keeping_reading(path, "\n".join(lines)))


if __name__ == "__main__":
    main()
