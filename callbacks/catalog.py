"""The README's table of the main plugins (README, "Your own module"), generated from the
plugins themselves: ``python -m lightning_fl.callbacks.catalog``."""

from __future__ import annotations

import inspect
import re

from lightning_fl import callbacks
from lightning_fl.engine.composition import module_needs

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


if __name__ == "__main__":
    print(plugin_table())
