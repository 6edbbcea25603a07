"""The contrastive losses of the torch runs (twins of `loss_jax`).

* `stable_loss`: `torchref.losses.info_nce` in float32 (eps-safe
  normalisation, the logit scale clamped at 100 through its temperature
  floor ``min_temperature = 1 / 100``).
* `naive_loss`: a first attempt, all in the compute dtype (no eps, no
  clamp, the logits and the cross-entropy in bfloat16/float16).

Both return ``(loss, aux)``: ``aux["checks"]`` is a
`torchref.diagnostics.CheckPoints` of the points of `probe.CHECKS` (0-d
tensors: nothing is read with ``.item()`` in the step; `fit` reads them
when it logs the step), and ``aux["logit_scale"]``.

Example:
    >>> import torch
    >>> img = torch.eye(4, 8); txt = torch.eye(4, 8); txt[3] = float("nan")
    >>> loss, aux = naive_loss(img, txt, torch.tensor(2.0), torch.zeros(4, 2))
    >>> aux["checks"].non_finite()
    ['text_emb', 'logits', 'loss']
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchref import diagnostics, losses

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp of exp(logit_scale)


def _checks(image, img, txt, logits, loss) -> diagnostics.CheckPoints:
    # the points of probe.CHECKS, in the order the step computes them
    return diagnostics.check_points(
        inputs=image, image_emb=img, text_emb=txt, logits=logits, loss=loss
    )


def _normalize_no_eps(x):
    return x / x.norm(dim=-1, keepdim=True)


def naive_loss(img, txt, log_scale, image):
    """Symmetric InfoNCE as a first attempt writes it, in the inputs' dtype."""
    scale = log_scale.to(img.dtype).exp()
    logits = scale * (_normalize_no_eps(img) @ _normalize_no_eps(txt).T)
    labels = torch.arange(logits.shape[0])
    loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    checks = _checks(image, img, txt, logits, loss)
    return loss, {"checks": checks, "logit_scale": scale.detach().float()}


def stable_loss(img, txt, log_scale, image, *, eps: float = 1e-8, checks=True):
    """`torchref.losses.info_nce` in float32, the logit scale clamped at 100.

    ``checks=False``: no check points, ``aux`` holds only the logit scale
    (what `benchmarks/bench_checks.py` compares against).

    Example:
        >>> x = torch.eye(3, 8).bfloat16()
        >>> loss, aux = stable_loss(x, x, torch.tensor(9.0), torch.zeros(3, 2))
        >>> round(float(loss), 4), float(aux["logit_scale"])
        (0.0, 100.0)
    """
    floor = 1.0 / MAX_LOGIT_SCALE
    temperature = (-log_scale.float()).exp()
    loss = losses.info_nce(
        img, txt, temperature=temperature, min_temperature=floor, eps=eps
    )
    scale = 1.0 / temperature.detach().clamp(min=floor)
    if not checks:
        return loss, {"logit_scale": scale}
    a = F.normalize(img.detach().float(), dim=1, eps=eps)
    b = F.normalize(txt.detach().float(), dim=1, eps=eps)
    marked = _checks(image, img, txt, scale * (a @ b.T), loss)
    return loss, {"checks": marked, "logit_scale": scale}
