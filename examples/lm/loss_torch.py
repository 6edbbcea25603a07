"""The language-model losses of the torch runs (twins of `loss_jax`).

* `stable_loss`: the library's float32 `torchref.losses.softmax_cross_entropy`
  with, when ``z_loss > 0``, its own z-loss term (``z_loss * mean(log^2 Z)``).
* `naive_loss`: ``logsumexp - logit[target]`` on the logits upcast to
  float32, no z-loss.

Both return ``(loss, aux)`` with the check points of `probe.CHECKS` (see
`loss_jax`), as 0-d tensors without gradient.

Example:
    >>> logits = torch.zeros(1, 2, 256, dtype=torch.bfloat16)
    >>> stats = torch.tensor([[0.5, 3.0], [4.0, 2.0]])
    >>> loss, aux = naive_loss(logits, torch.tensor([[1, 2]]), stats)
    >>> round(float(loss), 4)
    5.5452
    >>> float(aux["attn_logit_max"]), float(aux["attn_entropy_min"])
    (3.0, 2.0)
"""

from __future__ import annotations

import torch

from torchref import losses


def _aux(lse, ce, stats) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {
            "ce": ce.detach(),
            "log_z": lse.mean(),
            "log_z_abs_max": lse.abs().max(),
            "attn_logit_max": stats[0].max(),
            "attn_entropy_min": stats[1].min(),
        }


def naive_loss(logits, targets, stats):
    """Mean next-byte cross-entropy, written by hand on float32 logits."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    ce = (lse - torch.gather(lf, -1, targets[..., None])[..., 0]).mean()
    return ce, _aux(lse.detach(), ce, stats)


def stable_loss(logits, targets, stats, z_loss: float = 0.0):
    """`losses.softmax_cross_entropy` (float32) with its ``z_loss`` term.

    Example:
        >>> logits = torch.zeros(1, 2, 256, dtype=torch.bfloat16)
        >>> targets = torch.tensor([[1, 2]])
        >>> loss, aux = stable_loss(logits, targets, torch.ones(2, 1), 1e-4)
        >>> round(float(loss), 4), round(float(aux["ce"]), 4)
        (5.5483, 5.5452)
    """
    loss = losses.softmax_cross_entropy(
        logits.flatten(0, 1), targets.flatten(), dim=1, z_loss=z_loss
    )
    lse = torch.logsumexp(logits.detach().float(), dim=-1)
    # the check point's ce: the loss without the library's z-loss term
    ce = loss.detach() - z_loss * (lse**2).mean() if z_loss else loss
    return loss, _aux(lse, ce, stats)


def nll_sum(logits, targets) -> float:
    """Summed ``-log p(target)`` in float32 (the held-out metric's numerator).

    Example:
        >>> round(nll_sum(torch.zeros(1, 2, 256), torch.tensor([[1, 2]])), 4)
        11.0904
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    return float((lse - torch.gather(lf, -1, targets[..., None])[..., 0]).sum())
