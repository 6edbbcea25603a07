"""Every task's torch loss under DDP is the 1-process loss of the GLOBAL batch.

``compare.py ocr|contrastive|detection --devices N`` gathers each rank's
model outputs and targets before the loss (`examples.harness.collective.gather_rows`,
each task's ``parts_torch._global``). Here two ranks are simulated in this
process (no process group: `torch.distributed`'s ``all_gather`` and rank
queries are replaced by a fake that hands each rank the rows the other rank
computed): for every task and both losses (stable and naive), each rank's loss
VALUE equals the loss of the whole batch, and each rank's gradient of its own
output rows divided by the world size (DDP averages the ranks' gradients)
equals the 1-process gradient of those rows. The per-rank loss without the
gather differs (the reason for it): OCR's hard negatives are ranked and its
masked means taken per rank, InfoNCE sees only the rank's captions as
negatives, detection divides by the rank's own box count. The JAX side (one
SPMD program over the global arrays) is checked end to end in
`tests/test_compare_devices.py`.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from examples.contrastive import loss_torch as contrastive_loss
from examples.contrastive import parts_torch as contrastive_parts
from examples.detection import loss_torch as detection_loss
from examples.detection import parts_torch as detection_parts
from examples.harness import ddp
from examples.ocr import loss_torch as ocr_loss
from examples.ocr import parts_torch as ocr_parts

WORLD = 2


def _ocr_case(rng):
    b, s = 4, 8
    gt = np.zeros((b, s, s), np.float32)
    gt[0, 2:6, 2:6] = 1  # rank 0: one text region; rank 1: none at all
    gt[1, 1:3, 1:7] = 1
    mask = np.ones((b, s, s), np.float32)
    mask[3, :, :4] = 0  # an ignored half (DBNet's "###" regions)
    tmask = np.zeros((b, s, s), np.float32)
    tmask[0, 1:7, 1:7] = 1  # the threshold map's mask on rank 0's rows only
    tmask[1, :3] = 1
    maps = {
        "gt": gt,
        "mask": mask,
        "thresh_map": rng.uniform(0.3, 0.7, (b, s, s)).astype(np.float32),
        "thresh_mask": tmask,
    }
    out = {
        "logits": rng.normal(0, 2, (b, s, s)).astype(np.float32),
        "thresh": rng.uniform(0.2, 0.8, (b, s, s)).astype(np.float32),
    }
    out["logits"][2, 0, 0] = 0.0  # a kink: sigmoid exactly 0.5
    batch = {k: torch.from_numpy(v) for k, v in maps.items()}
    batch["image"] = torch.zeros(b, 3, s, s)  # not read by the loss

    def loss(o, bt, naive):
        o, maps = ocr_parts._global(o, bt)
        if naive:
            return ocr_loss.naive_loss(o, maps)[0]
        return ocr_loss.stable_loss(o, maps)[0]

    return out, batch, loss


def _contrastive_case(rng):
    b, d = 6, 5
    img = rng.normal(size=(b, d)).astype(np.float32)
    txt = rng.normal(size=(b, d)).astype(np.float32)
    txt[4] = img[4]  # a perfect pair on rank 1
    img[5] = img[1]  # equal embeddings on both ranks (a tie in the logits)
    out = {"img": img, "txt": txt}
    batch = {"image": torch.from_numpy(rng.normal(size=(b, 3, 2, 2)).astype("f"))}
    scale = torch.tensor(2.0)

    def loss(o, bt, naive):
        img, txt, image = contrastive_parts._global(o["img"], o["txt"], bt["image"])
        fn = contrastive_loss.naive_loss if naive else contrastive_loss.stable_loss
        return fn(img, txt, scale, image)[0]

    return out, batch, loss


def _detection_case(rng):
    from examples.detection import data

    b, g, c, k = 4, 4, 3, 3
    heat = np.zeros((b, g, g, c), np.float32)
    heat[0, 1, 2, 0] = 1.0
    heat[2, 3, 3, 2] = 0.5
    box_mask = np.zeros((b, k), bool)
    box_mask[0, :3] = True  # rank 0: 3 boxes; rank 1: 1 box
    box_mask[2, 0] = True
    boxes = np.tile(np.array([2.0, 2.0, 9.0, 11.0], np.float32), (b, k, 1))
    boxes[0, 1] = boxes[0, 0]  # equal boxes
    targets = {
        "boxes": boxes,
        "classes": np.zeros((b, k), np.int64),
        "box_mask": box_mask,
        "cells": rng.integers(0, g * g, (b, k)),
        "heatmap": heat,
    }
    assert set(targets) == set(data.BOX_KEYS)
    out = {
        "cls": rng.normal(-2, 1, (b, c, g, g)).astype(np.float32),
        "box": rng.normal(0, 0.5, (b, 4, g, g)).astype(np.float32),
    }
    batch = {key: torch.from_numpy(v) for key, v in targets.items()}
    batch["image"] = torch.zeros(b, 3, 2, 2)

    def loss(o, bt, naive):
        o, tg = detection_parts._global(o, bt)
        fn = detection_loss.naive_loss if naive else detection_loss.stable_loss
        return fn(o, tg)[0]

    return out, batch, loss


CASES = {"ocr": _ocr_case, "contrastive": _contrastive_case,
         "detection": _detection_case}  # fmt: skip


def _rows(tree, r):
    n = len(next(iter(tree.values())))
    rows = slice(r * n // WORLD, (r + 1) * n // WORLD)
    return {key: v[rows] for key, v in tree.items()}


def _leaves(out):
    return {key: torch.tensor(v, requires_grad=True) for key, v in out.items()}


class _FakeGroup:
    """`torch.distributed` for `WORLD` ranks simulated one after the other:
    while ``recording``, each rank's wires are kept in call order (the
    other ranks' rows are stand-ins); then each rank is handed the other
    ranks' recorded wires at the same call."""

    def __init__(self, monkeypatch):
        self.rank, self.calls, self.wires, self.recording = 0, 0, {}, True
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setitem(ddp._COLLECTIVE, "on", True)

    def start(self, rank, recording):
        self.rank, self.calls, self.recording = rank, 0, recording

    def all_gather(self, parts, wire, group=None, async_op=False):
        if self.recording:
            self.wires.setdefault(self.rank, []).append(wire.clone())
        for j in range(WORLD):
            known = j != self.rank and j in self.wires
            parts[j].copy_(self.wires[j][self.calls] if known else wire)
        self.calls += 1


@pytest.mark.parametrize("naive", [False, True], ids=["stable", "naive"])
@pytest.mark.parametrize("task", sorted(CASES))
def test_each_rank_computes_the_global_loss(task, naive, monkeypatch):
    out, batch, loss = CASES[task](np.random.default_rng(0))
    # one process: the whole batch (no collective)
    whole = _leaves(out)
    ref = loss(whole, batch, naive)
    ref.backward()
    group = _FakeGroup(monkeypatch)
    for r in range(WORLD):  # record every rank's wires, in call order
        group.start(r, recording=True)
        with torch.no_grad():
            loss(_leaves(_rows(out, r)), _rows(batch, r), naive)
    for r in range(WORLD):
        group.start(r, recording=False)
        mine = _leaves(_rows(out, r))
        value = loss(mine, _rows(batch, r), naive)
        value.backward()
        assert torch.isfinite(value) and value.dtype == ref.dtype
        # the value: the 1-process loss, on every rank (float32 sums in
        # another order: a few ulps)
        torch.testing.assert_close(value, ref, rtol=2e-6, atol=0)
        for key, leaf in mine.items():
            want = _rows({key: whole[key].grad}, r)[key]
            # DDP averages the ranks' gradients: each rank's own rows carry
            # WORLD times their share
            torch.testing.assert_close(leaf.grad / WORLD, want, rtol=1e-5, atol=1e-7)
    # without the gather, a rank's loss is not the whole batch's
    monkeypatch.setitem(ddp._COLLECTIVE, "on", False)
    local = loss(_leaves(_rows(out, 1)), _rows(batch, 1), naive).detach()
    ref = float(ref.detach())
    assert abs(float(local) - ref) > 1e-3 * abs(ref)


def test_gather_rows_is_identity_outside_a_ddp_forward():
    x = torch.ones(2, 3, requires_grad=True)
    tree = {"x": x, "pair": (x, [x]), "n": 4}
    out = ddp.gather_rows(tree)
    assert out is tree  # one process, or diagnostics' re-run on one rank


def test_gather_rows_refuses_a_scalar_and_complex(monkeypatch):
    _FakeGroup(monkeypatch)
    with pytest.raises(ValueError, match="got a 0-d tensor"):
        ddp.gather_rows({"loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="got a complex tensor"):
        ddp.gather_rows([torch.ones(2, dtype=torch.complex64)])


def test_gather_rows_keeps_dtypes_and_non_tensors(monkeypatch):
    group = _FakeGroup(monkeypatch)
    tree = {
        "half": torch.tensor([[1.0009765625]], dtype=torch.float16),
        "bf16": torch.tensor([3.0078125], dtype=torch.bfloat16),
        "big": torch.tensor([2**40 + 1], dtype=torch.int64),
        "f64": torch.tensor([1 + 2**-40], dtype=torch.float64),
        "flag": torch.tensor([True]),
        "name": "rows",
    }
    group.start(0, recording=True)
    out = ddp.gather_rows((tree, [tree["half"]]))
    first, (half,) = out
    for key in ("half", "bf16", "big", "f64", "flag"):
        assert first[key].dtype == tree[key].dtype
        assert first[key].shape[0] == WORLD * tree[key].shape[0]
        assert torch.equal(first[key][:1], tree[key])  # exact round trip
    assert first["name"] == "rows" and half.shape == (2, 1)


def _jax_loss(task, naive):
    """The case's JAX twin of `CASES`' torch loss (NHWC outputs)."""
    import jax.numpy as jnp

    from examples.contrastive import loss_jax as contrastive_jax
    from examples.detection import loss_jax as detection_jax
    from examples.ocr import loss_jax as ocr_jax

    module = {"ocr": ocr_jax, "contrastive": contrastive_jax,
              "detection": detection_jax}[task]  # fmt: skip
    fn = module.naive_loss if naive else module.stable_loss
    if task == "contrastive":
        return lambda o, b: fn(o["img"], o["txt"], jnp.asarray(2.0), b["image"])[0]
    return lambda o, b: fn(o, b)[0]


def _jax_inputs(task):
    """A case's outputs and batch as numpy, in JAX's layout (NHWC)."""
    outputs, batch, _ = CASES[task](np.random.default_rng(0))
    if task == "detection":  # the torch model's outputs are NCHW
        outputs = {k: np.moveaxis(v, 1, -1) for k, v in outputs.items()}
    batch = {k: v.numpy() for k, v in batch.items()}
    batch["image"] = np.moveaxis(batch["image"], 1, -1)
    return outputs, batch


def jax_global_losses() -> dict:
    """In a process with 2 JAX devices (`tests/test_compare_devices.py`'s
    subprocess): every case's JAX loss and gradient of the outputs with the
    whole batch split over 2 devices (the harness's data-parallel placement,
    `jaxstable.distributed.shard_batch`), all in one jitted program (one
    compile).

    Returns ``{(task, naive): (loss, {output: gradient}, sharded)}``,
    numpy; ``sharded``: every input was split over the 2 devices.
    """
    import jax

    from jaxstable import distributed

    keys = [(task, naive) for task in sorted(CASES) for naive in (False, True)]
    mesh = distributed.make_mesh(2)
    inputs = distributed.shard_batch([_jax_inputs(t) for t, _ in keys], mesh)
    sharded = [
        all(len(x.sharding.device_set) == 2 for x in jax.tree.leaves(io))
        for io in inputs
    ]

    def total(outputs, batches):
        cases = zip(keys, outputs, batches, strict=True)
        losses = [_jax_loss(*key)(o, b) for key, o, b in cases]
        return sum(losses), losses  # each case's outputs are its own leaves

    step = jax.jit(jax.value_and_grad(total, has_aux=True))
    (_, losses), grads = step([o for o, _ in inputs], [b for _, b in inputs])
    return {
        key: (float(loss), jax.tree.map(np.asarray, grad), ok)
        for key, loss, grad, ok in zip(keys, losses, grads, sharded, strict=True)
    }
