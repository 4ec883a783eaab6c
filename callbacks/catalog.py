"""The README's tables generated from the plugins themselves: the main plugins (README,
"Your own module"; ``python -m lightning_fl.callbacks.catalog``) and the refused pairs, by
the traits the package's plugins declare (README, "Plugins compose";
``python -m lightning_fl.callbacks.catalog refusals``)."""

from __future__ import annotations

import inspect
import re

from lightning_fl import callbacks, datamodules
from lightning_fl.engine import composition
from lightning_fl.engine.composition import module_needs
from lightning_fl.systems import samplers

#: The plugins of the README's table (README, "Your own module"), in its order.
MAIN_PLUGINS = (
    "FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedProx", "SCAFFOLD", "DPSGD",
    "Ditto", "APFL", "FedRep", "PFedMe", "FineTune", "KNNPer", "FedEM", "ClusteredFL",
    "GossipAveraging", "AsynchronousFL", "SAFARI", "Unlearning", "FreeRiders",
    "MembershipInference", "DPFedAvg", "CoordinateMedian", "TrimmedMean", "Krum",
    "CenteredClipping", "SignFlipping", "ScaledUpdates", "GaussianUpdates",
    "FederatedObjective", "Local", "Pooled", "SecureAggregation",
)  # fmt: skip


def plugin_table() -> str:
    """The README's table of the main plugins: their arguments with defaults (from their
    signatures), what each calls on your module besides Lightning's hooks (from
    :func:`~lightning_fl.engine.composition.module_needs` and ``module_type``, the contract
    :func:`~lightning_fl.engine.composition.check` enforces) and
    the first paragraph of their docstrings."""
    rows = ["| plugin | arguments (defaults) | needs from your module | what it is |"]
    rows.append("|---|---|---|---|")
    for name in MAIN_PLUGINS:
        plugin = getattr(callbacks, name)
        arguments = [
            f"`{p.name}`" if p.default is p.empty else f"`{p.name}={p.default!r}`"
            for p in inspect.signature(plugin).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        needs = [f"`{need}`" for need in module_needs(plugin)]
        if getattr(plugin, "module_type", None):
            needs.insert(0, f"a `{plugin.module_type}`")
        rows.append(
            f"| `{name}` | {', '.join(arguments) or '—'} | "
            f"{'; '.join(needs) or 'training_step only'} | {_summary(plugin.__doc__)} |"
        )
    return "\n".join(rows)


def _summary(docstring: str | None, longest: int = 160) -> str:
    """A docstring's first paragraph as one markdown line, cut at a word near ``longest``."""
    first = " ".join(inspect.cleandoc(docstring or "").split("\n\n")[0].split())
    first = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", first).replace("``", "`")
    if len(first) > longest:
        first = first[: first.rfind(" ", 0, longest)].rstrip(",;:") + " …"
    return first.replace("|", "∣")


def package_plugins() -> list[type]:
    """The plugin classes the package exports: callbacks, samplers and datamodules, each
    family by name."""
    return [
        value
        for module in (callbacks, samplers, datamodules)
        for _, value in sorted(vars(module).items())
        if isinstance(value, type) and value.__module__.startswith("lightning_fl")
    ]


def refusal_table() -> str:
    """The README's table of refused pairs: each composition rule, with the package's
    plugins that declare its traits (:func:`~lightning_fl.engine.composition.refusal_table`)."""
    return composition.refusal_table(package_plugins())


if __name__ == "__main__":
    import sys

    print(refusal_table() if sys.argv[1:] == ["refusals"] else plugin_table())
