"""Black-box membership-inference attacks on a classifier's output probabilities.

- the threshold attacks of Song & Mittal, "Systematic Evaluation of Privacy Risks of
  Machine Learning Models" (USENIX Security 2021, §3): prediction correctness, confidence
  F(x)_y, entropy and modified entropy
  Mentr(F(x), y) = −(1 − F_y) log F_y − Σ_{i≠y} F_i log(1 − F_i), with class-dependent
  thresholds;
- the loss-threshold attack of Yeom et al., "Privacy Risk in Machine Learning" (CSF 2018,
  §3.2): a sample is a member when its loss is below a threshold.

Protocol: members and non-members are subsampled to the same size (a balanced attack, so
0.5 is chance); each set is split in two halves; thresholds are fitted on the first
halves (per class for Song & Mittal, one threshold for Yeom) to maximize the attack
accuracy and the accuracy is measured on the second halves. Each attack's ROC AUC is
threshold-free, over the whole balanced sets: the probability that a member's score
exceeds a non-member's, ties counting one half (:func:`roc_auc`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fl.engine.seeding import generator

ATTACKS = ("correctness", "confidence", "entropy", "modified_entropy", "loss")
_EPS = 1e-30


def attack_signals(probs: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Every attack's per-sample score, oriented so that a higher score means "member"."""
    probs = probs.double().clamp(0.0, 1.0)
    p_true = probs.gather(1, labels[:, None]).squeeze(1)
    log = torch.log(probs.clamp_min(_EPS))
    log_rest = torch.log((1 - probs).clamp_min(_EPS))
    entropy = -(probs * log).sum(1)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).bool()
    others = torch.where(onehot, torch.zeros_like(probs), probs * log_rest)
    modified = -(1 - p_true) * torch.log(p_true.clamp_min(_EPS)) - others.sum(1)
    return {
        "correctness": (probs.argmax(1) == labels).double(),
        "confidence": p_true,
        "entropy": -entropy,
        "modified_entropy": -modified,
        "loss": torch.log(p_true.clamp_min(_EPS)),  # −cross-entropy
    }


def best_threshold(member: Tensor, nonmember: Tensor) -> float:
    """The threshold t maximizing the balanced accuracy of "member iff score ≥ t"."""
    scores = torch.cat([member, nonmember])
    is_member = torch.cat([torch.ones_like(member), torch.zeros_like(nonmember)])
    order = torch.argsort(scores, descending=True)
    scores, is_member = scores[order], is_member[order]
    # predicting "member" for the first j samples (j = 0..N): true positives and negatives
    tp = torch.cat([torch.zeros(1, dtype=is_member.dtype), torch.cumsum(is_member, 0)])
    fp = torch.arange(len(scores) + 1, dtype=is_member.dtype) - tp
    tn = len(nonmember) - fp
    accuracy = 0.5 * tp / max(len(member), 1) + 0.5 * tn / max(len(nonmember), 1)
    # a cut is only valid between distinct scores
    valid = torch.ones(len(scores) + 1, dtype=torch.bool)
    valid[1:-1] = scores[1:] != scores[:-1]
    j = int(torch.argmax(torch.where(valid, accuracy, torch.full_like(accuracy, -1.0))))
    if j == 0:
        return float("inf")
    return float(scores[j - 1])


def roc_auc(member: Tensor, nonmember: Tensor) -> float:
    """P(s_member > s_nonmember) + ½ P(s_member = s_nonmember), by the Mann–Whitney
    rank sum with average ranks for ties (0.5 for no separation, 1 for perfect).

    >>> roc_auc(torch.tensor([3.0, 2.0, 2.0]), torch.tensor([2.0, 1.0]))
    0.8333333333333334
    """
    from scipy.stats import rankdata

    scores = torch.cat([member, nonmember]).double().cpu().numpy()
    ranks = rankdata(scores)[: len(member)]
    u = ranks.sum() - len(member) * (len(member) + 1) / 2
    return float(u / (len(member) * len(nonmember)))


@dataclass
class AttackResult:
    accuracy: dict[str, float]
    #: each attack's ROC AUC (:func:`roc_auc`)
    auc: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> float:
        return max(self.accuracy.values())

    @property
    def best_auc(self) -> float:
        return max(self.auc.values())


def membership_inference(
    member_probs: Tensor,
    member_labels: Tensor,
    nonmember_probs: Tensor,
    nonmember_labels: Tensor,
    seed: int = 0,
    attacks: tuple[str, ...] = ATTACKS,
    per_class: bool = True,
) -> AttackResult:
    """Balanced attack accuracies of ``attacks`` (see the module docstring)."""
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise ValueError(f"Unknown attacks {sorted(unknown)}; choose from {ATTACKS}.")
    size = min(len(member_labels), len(nonmember_labels))
    if size < 2:
        raise ValueError(
            f"Membership inference needs at least 2 members and 2 non-members, got "
            f"{len(member_labels)} and {len(nonmember_labels)}."
        )
    g = generator(seed, "membership", size)
    m_idx = torch.randperm(len(member_labels), generator=g)[:size]
    n_idx = torch.randperm(len(nonmember_labels), generator=g)[:size]
    m_sig = attack_signals(member_probs[m_idx], member_labels[m_idx])
    n_sig = attack_signals(nonmember_probs[n_idx], nonmember_labels[n_idx])
    m_lab, n_lab = member_labels[m_idx], nonmember_labels[n_idx]
    half = size // 2
    fit, score = slice(0, half), slice(half, size)
    accuracy, auc = {}, {}
    for attack in attacks:
        m, n = m_sig[attack], n_sig[attack]
        auc[attack] = roc_auc(m, n)
        if attack == "correctness":
            predicted_m, predicted_n = m[score] >= 1, n[score] >= 1
        else:
            classes = (
                torch.unique(torch.cat([m_lab, n_lab])) if per_class and attack != "loss" else None
            )
            default = best_threshold(m[fit], n[fit])
            thresholds = {}
            for c in [] if classes is None else classes.tolist():
                mc, nc = m[fit][m_lab[fit] == c], n[fit][n_lab[fit] == c]
                thresholds[c] = best_threshold(mc, nc) if len(mc) and len(nc) else default
            predicted_m = m[score] >= _per_sample(thresholds, default, m_lab[score])
            predicted_n = n[score] >= _per_sample(thresholds, default, n_lab[score])
        tpr = predicted_m.double().mean()
        tnr = 1 - predicted_n.double().mean()
        accuracy[attack] = float(0.5 * (tpr + tnr))
    return AttackResult(accuracy, auc)


def _per_sample(thresholds: dict[int, float], default: float, labels: Tensor) -> Tensor:
    values = [thresholds.get(int(c), default) for c in labels.tolist()]
    return torch.tensor(values, dtype=torch.float64)
