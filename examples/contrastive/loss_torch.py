"""The contrastive losses of the torch runs (twins of `loss_jax`).

* `stable_loss`: `torchref.losses.info_nce` in float32 (eps-safe
  normalisation, the logit scale clamped at 100 through its temperature
  floor ``min_temperature = 1 / 100``).
* `naive_loss`: a first attempt, all in the compute dtype (no eps, no
  clamp, the logits and the cross-entropy in bfloat16/float16).

Both return ``(loss, aux)`` with ``aux["checks"]`` per check point of
`CHECKS` (``finite`` and ``max_abs`` as 0-d tensors: nothing is read with
``.item()`` in the step; `fit` converts them when it logs the step) and
``aux["logit_scale"]``.

Example:
    >>> import torch
    >>> img = torch.eye(4, 8); txt = torch.eye(4, 8); txt[3] = float("nan")
    >>> loss, aux = naive_loss(img, txt, torch.tensor(2.0), torch.zeros(4, 2))
    >>> first_bad(aux["checks"])
    'text_emb'
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.contrastive.config import CHECKS, first_bad  # noqa: F401
from torchref import losses

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp of exp(logit_scale)


def check_points(**values: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {"finite": bool tensor, "max_abs": float32 tensor}}``, no sync.

    Example:
        >>> c = check_points(x=torch.tensor([1.0, -3.0]),
        ...                  y=torch.tensor([float("inf"), 2.0]))
        >>> bool(c["x"]["finite"]), float(c["x"]["max_abs"]), bool(c["y"]["finite"])
        (True, 3.0, False)
    """
    out = {}
    for name, x in values.items():
        x = x.detach()
        ok = torch.isfinite(x)
        big = torch.where(ok, x.abs(), torch.zeros_like(x)).max().float()
        out[name] = {"finite": ok.all(), "max_abs": big}
    return out


def _normalize_no_eps(x):
    return x / x.norm(dim=-1, keepdim=True)


def naive_loss(img, txt, log_scale, image):
    """Symmetric InfoNCE as a first attempt writes it, in the inputs' dtype."""
    scale = log_scale.to(img.dtype).exp()
    logits = scale * (_normalize_no_eps(img) @ _normalize_no_eps(txt).T)
    labels = torch.arange(logits.shape[0])
    loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    checks = check_points(
        inputs=image, image_emb=img, text_emb=txt, logits=logits, loss=loss
    )
    return loss, {"checks": checks, "logit_scale": scale.detach().float()}


def stable_loss(img, txt, log_scale, image, *, eps: float = 1e-8):
    """`torchref.losses.info_nce` in float32, the logit scale clamped at 100.

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
    a = F.normalize(img.detach().float(), dim=1, eps=eps)
    b = F.normalize(txt.detach().float(), dim=1, eps=eps)
    checks = check_points(
        inputs=image, image_emb=img, text_emb=txt, logits=scale * (a @ b.T), loss=loss
    )
    return loss, {"checks": checks, "logit_scale": scale}
