"""Sites across institutions on Flower's runtime (``pip install "lightning-fl[flower]"``).

Each site runs its own ``lightning-fl fit --silo NAME`` beside a Flower SuperNode that
dials out to the federation's SuperLink over TLS, authenticated by its node key. The
engine's collectives (:mod:`lightning_fl.engine.collectives`) travel as Flower messages:

- :class:`~lightning_fl.flower.site.FlowerSite` (``FederatedStrategy(transport=
  FlowerSite())``) is the site's transport: at each collective it hands its part to the
  site's ClientApp, through a Unix socket only that site's user can open (the
  *mailbox*), and waits for the result;
- :data:`~lightning_fl.flower.apps.client_app` (the ClientApp) carries one step's bytes
  between the SuperNode and the mailbox, unread;
- :data:`~lightning_fl.flower.apps.server_app` (the ServerApp) holds no model and no
  data: at each step it adds the sites' tensors (or, with ``SecureAggregation``, their
  masked limbs) and lists their small values in site order, and sends the result with the
  next step's request.

README, "Deploying across hospitals", walks through a deployment.
"""

from typing import Any

__all__ = ["FlowerRunStopped", "FlowerSite"]


def __getattr__(name: str) -> Any:
    """The site's classes, imported on first use: the ClientApp, which only carries
    bytes, starts without torch."""
    if name in __all__:
        from lightning_fl.flower import site

        return getattr(site, name)
    raise AttributeError(f"module 'lightning_fl.flower' has no attribute {name!r}")
