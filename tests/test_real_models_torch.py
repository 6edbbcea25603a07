"""The models users train, in torch: real model code, random weights, tiny sizes.

transformers' GPT-2 and Llama (built from a config, nothing downloaded) and
a ResNet-18-shaped network with torchvision's module names and
initialisation (no torchvision wheel here matches the CPU torch build the
Makefile installs: see the Makefile), each trained through
`torchref.train.TrainStep` under bfloat16 autocast. For each: the loss
falls; a batch with a NaN in its float data is skipped with the model (its
batch-norm buffers included) and the optimizer state bitwise unchanged; a
run resumed from a checkpoint equals the uninterrupted one bit for bit;
`locate` names where a real float16 overflow starts by the model's own
dotted module name.

The mirror of `tests/test_real_models_jax.py` (the NNX transformer and the
NNX ResNet-18 shape). Budget: module-scoped runs, 4x16 tokens, 32x32 images.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from torchref import diagnostics, losses, train

VOCAB, BATCH, SEQ = 64, 4, 16
TRAIN_STEPS, AFTER = 4, 2  # steps before the checkpoint; steps after the bad one


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )  # GPT-2's own dropout (0.1 in embeddings, attention, residuals) stays on
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention, as Llama 2/3
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: same structure, same names."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        skip = x if self.downsample is None else self.downsample(x)
        x = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(x)) + skip)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (stem, 4 stages of 2 BasicBlocks, fc:
    ``layer3.1.conv2`` is that module there too), widths divided by 16."""

    def __init__(self, width: int = 4, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        chans = [width * 2**i for i in range(4)]
        for i, (cin, cout) in enumerate(zip([width, *chans[:-1]], chans, strict=True)):
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(chans[-1], num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(x.mean(dim=(2, 3)))


def lm_loss(model, batch):
    """Next-token cross-entropy, weighted per token (as prompt masking in
    fine-tuning): the float `weights` carry the bad value of a bad batch."""
    logits = model(input_ids=batch["ids"]).logits[:, :-1]
    per_token = losses.softmax_cross_entropy(
        logits.reshape(-1, VOCAB), batch["ids"][:, 1:].reshape(-1), reduction="none"
    )
    w = batch["weights"][:, 1:].reshape(-1)
    return (per_token * w).sum() / w.sum()


def image_loss(model, batch):
    return losses.softmax_cross_entropy(model(batch["images"]), batch["labels"])


def lm_batch(bad: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    weights = torch.ones(BATCH, SEQ)
    if bad:
        weights[1, 3] = float("nan")  # a corrupted weight in the data
    return {
        "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "weights": weights,
    }


def image_batch(bad: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 32, 32, generator=g)
    if bad:
        images[2, 0, 5, 7] = float("nan")  # one corrupted pixel
    return {"images": images, "labels": torch.randint(0, 10, (8,), generator=g)}


def lm_recipe(params) -> dict:
    return dict(optimizer=torch.optim.AdamW(params, lr=1e-2), max_grad_norm=1.0)


def image_recipe(params) -> dict:
    return dict(optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9))


# model, loss, batch, recipe: each model's usual optimizer (AdamW with
# clipping for the language models, SGD with momentum for the ResNet); no
# GradScaler, as bfloat16 needs none (float16's is tested in torchref/tests
# and parity_tests).
MODELS = {
    "gpt2": (gpt2, lm_loss, lm_batch, lm_recipe),
    "llama": (llama, lm_loss, lm_batch, lm_recipe),
    "resnet18": (ResNet18, image_loss, image_batch, image_recipe),
}


def make_step(name: str, seed: int = 0, autocast=torch.bfloat16) -> train.TrainStep:
    build, loss_fn, _, recipe = MODELS[name]
    torch.manual_seed(seed)
    model = build()
    kw = recipe(model.parameters())
    return train.TrainStep(
        model, kw.pop("optimizer"), loss_fn, autocast_dtype=autocast, **kw
    )


def snapshot(step: train.TrainStep) -> dict:
    """Everything the step carries (model with its buffers, optimizer,
    scaler, counters), copied."""
    return copy.deepcopy(step.state_dict())


def assert_equal(a, b, path: str = "") -> None:
    """Bitwise equality of two state dicts, naming the first leaf that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="module", params=sorted(MODELS))
def run(request, tmp_path_factory):
    """A run: TRAIN_STEPS steps, a checkpoint, a bad batch, AFTER steps."""
    name = request.param
    batch = MODELS[name][2]
    step = make_step(name)
    losses_ = [step(batch())["loss"] for _ in range(TRAIN_STEPS)]
    path = tmp_path_factory.mktemp(name) / "ckpt.pt"
    train.save_checkpoint(path, step)
    before = snapshot(step)
    bad = step(batch(bad=True))
    after_bad = snapshot(step)
    for _ in range(AFTER):
        assert step(batch())["finite"]
    return dict(
        name=name,
        losses=losses_,
        path=path,
        before=before,
        bad=bad,
        after_bad=after_bad,
        end=snapshot(step),
    )


def test_trains_in_bfloat16(run):
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    assert run["losses"][-1] < run["losses"][0]


def test_bad_batch_is_skipped_bitwise(run):
    m, before, after = run["bad"], run["before"], run["after_bad"]
    assert (m["finite"], m["grads_finite"], m["skipped_total"]) == (False, False, 1)
    # the model (parameters and batch-norm buffers) and the optimizer state
    # exactly as before the step; the step counted
    assert_equal(after["model"], before["model"], "model")
    assert_equal(after["optimizer"], before["optimizer"], "optimizer")
    assert after["scaler"] == before["scaler"] == {}
    assert after["steps_done"] == before["steps_done"] + 1


def test_resume_is_exact(run):
    step = make_step(run["name"], seed=1)  # other initial weights: all from the file
    train.load_checkpoint(run["path"], step)
    assert_equal(snapshot(step), run["before"])
    batch = MODELS[run["name"]][2]
    assert not step(batch(bad=True))["finite"]
    for _ in range(AFTER):
        step(batch())
    assert_equal(snapshot(step), run["end"])


# Weights grown to a size float16 cannot carry (nothing else changed): where
# the first non-finite value appears, by the model's own module names.
def test_locate_gpt2_gelu_backward_overflow():
    step = make_step("gpt2", autocast=torch.float16)
    with torch.no_grad():
        step.model.transformer.h[1].mlp.c_fc.weight.mul_(1000.0)
    loc = diagnostics.locate(step, lm_batch())
    # GPT-2's tanh GELU computes x**3: inf above |x| = 40 in float16, which
    # its tanh hides in the forward; the backward multiplies 0 by 3 x**2,
    # inf above |x| = 148, and every gradient before the block is NaN.
    assert (loc.phase, loc.op) == ("backward", "pow")
    assert loc.path in dict(step.model.named_parameters())
    assert "in the output of pow in transformer.h.1.mlp.act" in loc.detail


def test_locate_llama_forward_overflow():
    step = make_step("llama", autocast=torch.float16)
    with torch.no_grad():
        step.model.model.layers[1].mlp.up_proj.weight.mul_(3e5)  # fits float16
    loc = diagnostics.locate(step, lm_batch())
    assert (loc.phase, loc.path) == ("forward", "model.layers.1.mlp.up_proj")
    assert loc.detail.startswith("float16 overflow")


def test_locate_resnet_forward_overflow():
    step = make_step("resnet18", autocast=torch.float16)
    with torch.no_grad():
        step.model.layer3[1].conv2.weight.mul_(5e4)  # still fits float16
    loc = diagnostics.locate(step, image_batch())
    assert (loc.phase, loc.path) == ("forward", "layer3.1.conv2")
    assert loc.detail.startswith("float16 overflow")
