"""Unit tests of torchref.losses (torch only; parity with JAX is in parity_tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchref import losses

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ce_inputs(n=4, n_classes=7, hw=(5, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, n_classes, *hw, generator=g) * 3).to(dtype)
    y = torch.randint(0, n_classes, (n, *hw), generator=g)
    y[torch.rand(n, *hw, generator=g) < 0.1] = 255
    return x, y


@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_matches_float64_and_returns_float32(dtype, tol):
    x, y = _ce_inputs(dtype=dtype)
    x = x.requires_grad_()
    out = losses.softmax_cross_entropy(x, y, ignore_index=255, label_smoothing=0.1)
    ref = F.cross_entropy(x.detach().double(), y, ignore_index=255, label_smoothing=0.1)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.item(), ref.item(), **tol("float32"))
    out.backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


def test_ce_any_class_dim(tol):
    x, y = _ce_inputs()
    base = losses.softmax_cross_entropy(x, y, ignore_index=255, reduction="none")
    last = losses.softmax_cross_entropy(
        x.movedim(1, -1), y, dim=-1, ignore_index=255, reduction="none"
    )
    np.testing.assert_allclose(last.numpy(), base.numpy(), **tol("float32"))
    flat = losses.softmax_cross_entropy(x[0, :, 0, 0], y[0, 0, 0].clamp(max=6), dim=0)
    assert flat.shape == ()


def test_ce_all_ignored_zero_with_zero_grad_native_is_nan():
    x, _ = _ce_inputs()
    x.requires_grad_()
    y = torch.full((4, 5, 5), 255)
    out = losses.softmax_cross_entropy(x, y, ignore_index=255, weights=torch.ones(7))
    out.backward()
    assert out.item() == 0.0 and not x.grad.any()
    assert torch.isnan(F.cross_entropy(x.detach(), y, ignore_index=255))


def test_ce_out_of_range_names_all_bad_values():
    x, y = _ce_inputs()
    y[0, 0, 0], y[1, 1, 1], y[2, 2, 2] = 9, -1, 9
    with pytest.raises(ValueError, match=r"3 element\(s\) with values \[-1, 9\]"):
        losses.softmax_cross_entropy(x, y, ignore_index=255)
    with pytest.raises(IndexError):  # torch's own check names only one value
        F.cross_entropy(x, y, ignore_index=255)


def test_ce_fp16_model_outside_autocast_is_finite():
    """seeds/000 in torch: a .half() model's logits, loss outside autocast."""
    x, y = _ce_inputs(dtype=torch.float16)
    x = (x.float() * 3000).clamp(-60000, 60000).half().requires_grad_()
    assert x.abs().max() > 10000
    out = losses.softmax_cross_entropy(x, y, ignore_index=255)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_db_step_grad_finite_reference_is_not_in_fp16(dtype):
    grid = torch.linspace(0, 1, 101)
    xs, ys = torch.meshgrid(grid, grid, indexing="ij")
    x = xs.to(dtype).requires_grad_()
    out = losses.db_step(x, ys.to(dtype))
    out.sum().backward()
    assert out.dtype == torch.float32 and torch.isfinite(x.grad).all()
    if dtype == torch.float16:
        xr = xs.half().requires_grad_()
        torch.reciprocal(1 + torch.exp(-50 * (xr - ys.half()))).sum().backward()
        assert not torch.isfinite(xr.grad).all()


def test_info_nce_learnable_temperature_clamped():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    t = torch.tensor(0.07, requires_grad=True)
    losses.info_nce(a, b, temperature=t).backward()
    assert t.grad.item() != 0.0
    t_low = torch.tensor(1e-6, requires_grad=True)
    out = losses.info_nce(a.bfloat16(), b.bfloat16(), temperature=t_low)
    out.backward()
    assert torch.isfinite(out) and t_low.grad.item() == 0.0


def test_info_nce_zero_rows_finite():
    a = torch.zeros(4, 8, requires_grad=True)
    b = torch.randn(4, 8)
    out = losses.info_nce(a, b)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(a.grad).all()


def test_empty_masks():
    p = torch.full((4, 4), 0.3, requires_grad=True)
    z = torch.zeros(4, 4)
    d = losses.dice_loss(p, z, z)
    l1 = losses.masked_l1_loss(p, z + 1, z)
    (d + l1).backward()
    assert d.item() == 1.0 and l1.item() == 0.0 and torch.isfinite(p.grad).all()


def test_balanced_bce_matches_explicit_selection(tol):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 16, generator=g) * 3
    gt = (torch.rand(2, 16, 16, generator=g) < 0.1).float()
    m = (torch.rand(2, 16, 16, generator=g) < 0.8).float()
    bce = F.binary_cross_entropy_with_logits(x.double(), gt.double(), reduction="none")
    pos, neg = (gt * m).bool(), ((1 - gt) * m).bool()
    k = min(int(neg.sum()), int(pos.sum() * 3))
    ref = (bce[pos].sum() + bce[neg].sort(descending=True).values[:k].sum()) / (
        pos.sum() + k + 1e-6
    )
    out = losses.balanced_binary_cross_entropy(x, gt, m)
    np.testing.assert_allclose(out.item(), ref.item(), **tol("float32"))


def test_array_likes_are_converted_onto_the_tensors_device():
    """A numpy array or list joins the device of the tensor inputs (here
    'meta', where nothing is computed), as jnp.asarray would convert it."""
    x = torch.empty(2, 4, device="meta")
    out = losses.sigmoid_binary_cross_entropy(x, np.ones((2, 4), np.float32))
    assert out.device.type == "meta"
    ones = [[1.0, 1.0], [1.0, 1.0]]
    l1 = losses.masked_l1_loss(ones, np.zeros((2, 2)), torch.ones(2, 2))
    assert l1.item() == 1.0 and l1.dtype == torch.float32


def test_zero_class_weight_sum_is_nan_with_nan_gradient():
    """F.cross_entropy divides by 0 here (+-inf or NaN); ours is NaN, and so
    is the gradient, so the guard skips the step."""
    x, y = _ce_inputs(n=2, n_classes=3, hw=(2, 2))
    y = y.clamp(max=2)  # no ignored element: every label counts
    x = x.requires_grad_()
    out = losses.softmax_cross_entropy(x, y, weights=torch.zeros(3))
    out.backward()
    assert torch.isnan(out) and torch.isnan(x.grad).all()
    assert torch.isnan(F.cross_entropy(x.detach(), y, weight=torch.zeros(3)))


def test_info_nce_is_float32_inside_autocast():
    # matmul is on autocast's bf16 list; the loss must not follow it there.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    t = torch.tensor(0.01, requires_grad=True)
    outside = losses.info_nce(a, b, temperature=t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = losses.info_nce(a, b, temperature=t)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, outside)


# issue 35 item 3: every loss computes inside torch.autocast exactly as outside
# it (CPU autocast takes bfloat16 and float16). linear_cross_entropy's blocks
# followed autocast to bf16 (loss 6.7e-4 off float64 here instead of 5.6e-7).
def _autocast_cases():
    g = torch.Generator().manual_seed(0)
    x, y = _ce_inputs(n=2, n_classes=3, hw=(3, 3))
    xb = torch.randn(2, 1, 4, 4, generator=g)
    t = (torch.rand(2, 1, 4, 4, generator=g) > 0.5).float()
    m = (torch.rand(2, 1, 4, 4, generator=g) > 0.2).float()
    p = torch.rand(2, 1, 4, 4, generator=g)
    box = torch.tensor([[0.5, 0.2, 4.0, 4.0], [1.0, 2.0, 3.5, 5.0]])
    h, w = torch.randn(12, 32, generator=g), torch.randn(300, 32, generator=g) * 0.3
    lab = torch.randint(0, 300, (12,), generator=g)
    lce = dict(block_size=128, label_smoothing=0.1, z_loss=1e-3)
    return {
        "softmax_cross_entropy": (
            lambda a: losses.softmax_cross_entropy(a, y, ignore_index=255, z_loss=1e-3),
            [x],
        ),
        "sigmoid_binary_cross_entropy": (
            lambda a: losses.sigmoid_binary_cross_entropy(a, t),
            [xb],
        ),
        "balanced_binary_cross_entropy": (
            lambda a: losses.balanced_binary_cross_entropy(a, t, m),
            [xb],
        ),
        "dice_loss": (lambda a: losses.dice_loss(a, t, m), [p]),
        "sigmoid_focal_loss": (
            lambda a: losses.sigmoid_focal_loss(a, t, reduction="mean"),
            [xb],
        ),
        "masked_l1_loss": (lambda a: losses.masked_l1_loss(a, t, m), [p]),
        "db_loss": (
            lambda a, b: losses.db_loss(a, b, t, m, p.flip(0), m),
            [xb, p],
        ),
        "info_nce": (lambda a, b: losses.info_nce(a, b), [h[:6], h[6:]]),
        "box_iou_loss": (
            lambda a: losses.box_iou_loss(a, box, kind="ciou", reduction="mean"),
            [box + 0.3],
        ),
        "linear_cross_entropy": (
            lambda a, b: losses.linear_cross_entropy(a, b, lab, **lce),
            [h, w],
        ),
    }


def _loss_and_grads(fn, inputs, dtype, autocast):
    leaves = [i.detach().to(dtype).clone().requires_grad_() for i in inputs]
    with torch.autocast(
        "cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)
    ):
        out = fn(*leaves)
    out.backward()  # outside autocast, as TrainStep and torch's amp recipe do
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(_autocast_cases()))
def test_every_loss_is_float32_inside_autocast(name, autocast, tol):
    fn, inputs = _autocast_cases()[name]
    outside, g_out = _loss_and_grads(fn, inputs, torch.float32, None)
    inside, g_in = _loss_and_grads(fn, inputs, torch.float32, autocast)
    exact, g_exact = _loss_and_grads(fn, inputs, torch.float64, None)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, outside), (name, float(inside - outside))
    for a, b, ref in zip(g_in, g_out, g_exact, strict=True):
        assert torch.equal(a, b), (name, float((a - b).abs().max()))
        torch.testing.assert_close(a.double(), ref, **tol("float32"))
    torch.testing.assert_close(inside.double(), exact, **tol("float32"))


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_backward_inside_autocast(autocast):
    # The custom backward recomputes the logits by matmul: run inside
    # torch.autocast (a `.backward()` within the block) it must not follow it.
    fn, inputs = _autocast_cases()["linear_cross_entropy"]
    h, w = (i.clone().requires_grad_() for i in inputs)
    loss = fn(h, w)
    gh, gw = torch.autograd.grad(loss, (h, w), retain_graph=True)
    with torch.autocast("cpu", dtype=autocast):
        gh_in, gw_in = torch.autograd.grad(loss, (h, w))
    assert torch.equal(gh_in, gh) and torch.equal(gw_in, gw)


# ---------------------------------------------------------------------------
# issue 22: gradients at kinks, the precision rule (parity: test_loss_kinks.py)
# ---------------------------------------------------------------------------


def test_bce_gradient_at_logit_zero_is_sigmoid_minus_target():
    x = torch.zeros(4, requires_grad=True)
    t = torch.tensor([1.0, 0.0, 1.0, 0.0])
    losses.sigmoid_binary_cross_entropy(x, t).backward()
    assert torch.equal(x.grad, torch.tensor([-0.125, 0.125, -0.125, 0.125]))


def test_balanced_bce_keeps_the_lowest_index_among_tied_negatives():
    """A zero-initialised head: every negative's loss is log 2, k = 3 of 13
    (one positive): the first three negatives get the gradient, as in
    jaxstable (torch.topk picks others among ties, unspecified)."""
    x = torch.zeros(14, requires_grad=True)
    gt = torch.zeros(14)
    gt[5] = 1.0
    losses.balanced_binary_cross_entropy(x, gt, torch.ones(14)).backward()
    picked = torch.nonzero(x.grad > 0).flatten().tolist()
    assert picked == [0, 1, 2] and x.grad[5] < 0


def test_float64_inputs_compute_in_float64():
    """The precision rule: float64 predictions give float64 results (values:
    parity_tests/test_loss_kinks.py); a float64 target alone does not."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(2, 8, 8, generator=g, dtype=torch.float64)
    gt = (torch.rand(2, 8, 8, generator=g) < 0.3).float()
    m = torch.ones(2, 8, 8)
    boxes = torch.tensor([[0.0, 0.0, 2.0, 3.0]], dtype=torch.float64)
    outs = [
        losses.softmax_cross_entropy(p[0], torch.arange(8), dim=-1),
        losses.sigmoid_binary_cross_entropy(p, gt),
        losses.balanced_binary_cross_entropy(p, gt, m),
        losses.dice_loss(p, gt, m),
        losses.masked_l1_loss(p, gt, m),
        losses.db_step(p, gt),
        losses.db_loss(p, p, gt, m, gt, m),
        losses.info_nce(p[0], p[1]),
        losses.box_iou_loss(boxes, boxes + 1.0, kind="ciou"),
        losses.sigmoid_focal_loss(p, gt),
    ]
    assert all(o.dtype == torch.float64 for o in outs), [o.dtype for o in outs]
    assert losses.sigmoid_binary_cross_entropy(p.float(), p).dtype == torch.float32
