"""The plugin contract's names where plugins and users import them; they live in
:mod:`lightning_fl.engine.plugins`, which the engine reads without importing this package."""

from lightning_fl.engine.plugins import (
    POOLED_CLIENT,
    SERVER_CLIENT,
    Aggregator,
    FederatedCallback,
    RoundState,
    Weighting,
)

__all__ = [
    "POOLED_CLIENT",
    "SERVER_CLIENT",
    "Aggregator",
    "FederatedCallback",
    "RoundState",
    "Weighting",
]
