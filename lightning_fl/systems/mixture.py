"""The FedEM model: M component classifiers and a client's mixture weights π_t
(Marfoq et al., NeurIPS 2021; Marfoq thesis §3.5)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fl.models import MLP, FederatedTask

#: q(x, y) -> [batch, M] responsibilities, set by the FedEM callback during local training.
Responsibilities = Callable[[Tensor, Tensor], Tensor]


def reset_parameters(module: nn.Module) -> None:
    """Draw fresh initial weights for every layer that knows how (``reset_parameters``)."""
    for layer in module.modules():  # includes ``module`` itself (a bare nn.Linear)
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()


class MixtureClassifier(FederatedTask):
    """M classifiers h_θ1..h_θM (Assumption 8) and the personalized predictor of eq. (3.5),
    h_t(x) = Σ_m π_tm softmax(h_θm(x)).

    ``forward`` returns log h_t(x), so cross-entropy on it is the mixture's negative
    log-likelihood (3.6) and its argmax is the mixture's prediction. Component 0 is
    ``network`` itself; the others are copies with fresh random initial weights (each
    component is initialized independently, as in the authors' code).

    Training loss: with responsibilities q set by :class:`~lightning_fl.callbacks.FedEM`
    (frozen at the round's start, Alg. 7), the EM surrogate Σ_i Σ_m q_im ℓ(h_θm(x_i), y_i)
    divided by the batch size, so component m's gradient is LocalSolver's
    Σ_i q(z_i=m)∇ℓ / |I|. Without it, the mixture's negative log-likelihood.

    π_t is a plain attribute (``log_mixture_weights``), not a parameter or buffer: it is
    client state kept in the client store, never averaged.

    Binary tasks with one logit: a network with one output z is a Bernoulli model
    p(y = 1 | x) = sigmoid(z), as the authors' synthetic experiments use (BCE loss, a
    mixture of sigmoids). It is handled as the two-logit form [0, z], for which
    softmax([0, z]) = (1 − sigmoid(z), sigmoid(z)) and the cross-entropy is BCE on z.
    """

    def __init__(
        self, network: nn.Module | None = None, num_components: int = 3, lr: float = 0.05, **optim
    ) -> None:
        if num_components < 1:
            raise ValueError(f"num_components must be >= 1, got {num_components}.")
        network = network if network is not None else MLP()
        super().__init__(network, lr=lr, **optim)
        copies = []
        for _ in range(num_components - 1):
            component = copy.deepcopy(network)
            reset_parameters(component)
            copies.append(component)
        self.network = nn.ModuleList([network, *copies])
        # host: built before the module moves; mixture_log_probs moves π to the logits
        self.log_mixture_weights = torch.full((num_components,), -math.log(num_components))
        self.responsibilities: Responsibilities | None = None

    @property
    def num_components(self) -> int:
        return len(self.network)

    def component_logits(self, x: Tensor, components: nn.ModuleList | None = None) -> Tensor:
        """[batch, M, classes], from this module's components or from ``components``; a
        one-logit binary component z gives the logits [0, z]."""
        components = self.network if components is None else components
        logits = torch.stack([component(x) for component in components], dim=1)
        if logits.shape[-1] == 1:
            logits = torch.cat([torch.zeros_like(logits), logits], dim=-1)
        return logits

    @staticmethod
    def _losses(log_probs: Tensor, y: Tensor) -> Tensor:
        index = y[:, None, None].expand(-1, log_probs.shape[1], 1)
        return -log_probs.gather(-1, index).squeeze(-1)

    def component_losses(
        self, x: Tensor, y: Tensor, components: nn.ModuleList | None = None
    ) -> Tensor:
        """ℓ(h_θm(x_i), y_i), the cross-entropy of every sample and component: [batch, M]."""
        return self._losses(F.log_softmax(self.component_logits(x, components), dim=-1), y)

    def _mixture(self, log_probs: Tensor) -> Tensor:
        log_pi = self.log_mixture_weights.to(log_probs.device, log_probs.dtype)
        return torch.logsumexp(log_pi[None, :, None] + log_probs, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        return self._mixture(F.log_softmax(self.component_logits(x), dim=-1))

    def loss_and_metrics(self, batch):
        x, y = batch
        log_probs = F.log_softmax(self.component_logits(x), dim=-1)
        mixture = self._mixture(log_probs)
        acc = (mixture.argmax(-1) == y).float().mean()
        if self.training and self.responsibilities is not None:
            with torch.no_grad():
                q = self.responsibilities(x, y)
            return (q * self._losses(log_probs, y)).sum(dim=1).mean(), {"acc": acc}
        return F.nll_loss(mixture, y), {"acc": acc}
