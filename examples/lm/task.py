"""The lm task of `examples/compare.py`: a byte-level decoder on Python's own sources.

A small decoder-only transformer (`model_jax.py`, `model_torch.py`,
`convert.py`) learns the next byte of 59 files of the running interpreter's
standard library (`data.py`: nothing to download); held-out loss and bits
per byte (`metric.py`). The losses return the check points of `probe.py` in
every step (max attention logit, attention entropy, log Z), and the report's
diagnosis is drawn from them (`probe.diagnose`): the naive bfloat16 run at a
high learning rate does not go NaN, it fails by attention-logit growth
(README.md). The parts of a run, naive and stable, are `parts_jax.py` /
`parts_torch.py`; the settings `config.py`; the learning-rate schedule
`schedule.py`; the README's learning-rate sweep `sweep.py`.

Example:
    >>> TASK.name, TASK.metrics, TASK.precision
    ('lm', ('bits_per_byte', 'heldout_loss'), 'bfloat16')
"""

from __future__ import annotations

import numpy as np

from examples.harness.config import check_int, check_positive
from examples.harness.parts import Task, own_part
from examples.lm import data, probe
from examples.lm.config import Config
from examples.lm.metric import METRICS


def check_config(c: Config) -> None:
    """The values the data and the model cannot take (ValueError naming them).

    Example:
        >>> TASK.get_config(width=10)
        Traceback (most recent call last):
        ...
        ValueError: width must be a multiple of n_heads (4), got 10
    """
    for name, minimum in (("seq_len", 2), ("n_layers", 1), ("n_heads", 1),
                          ("warmup_steps", 1), ("spike_window", 1),
                          ("spike_min_history", 1)):  # fmt: skip
        check_int(name, getattr(c, name), minimum)
    if c.width % c.n_heads:
        raise ValueError(
            f"width must be a multiple of n_heads ({c.n_heads}), got {c.width}"
        )
    if not 0 <= c.final_lr_fraction <= 1:
        raise ValueError(
            f"final_lr_fraction must be in [0, 1], got {c.final_lr_fraction}"
        )
    if (
        isinstance(c.z_loss, bool)
        or not isinstance(c.z_loss, int | float)
        or not (0 <= c.z_loss < float("inf"))
    ):
        raise ValueError(f"z_loss must be a finite number >= 0, got {c.z_loss!r}")
    for name in ("qk_norm", "spike_guard"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(c, name)!r}")
    if c.spike_min_history > c.spike_window:
        raise ValueError(
            f"spike_min_history ({c.spike_min_history}) must be <= spike_window "
            f"({c.spike_window})"
        )
    for name in ("attention_logit_limit", "entropy_floor", "log_z_limit",
                 "spike_threshold"):  # fmt: skip
        check_positive(name, getattr(c, name))


def describe(c: Config) -> str:
    """The "Setup:" sentence of the report."""
    info = data.load_corpus()[2]
    return (
        f"next-byte prediction on {info['files']} files of this interpreter's "
        f"standard library ({info['train_bytes']:,} train bytes, sha256 "
        f"{info['train_sha256']}; the last 10% of every file held out, "
        f"{info['heldout_bytes']:,} bytes, {info['heldout_sha256']}); a pre-LN "
        f"decoder, width {c.width}, {c.n_layers} layers, {c.n_heads} heads, "
        f"{c.seq_len}-byte windows; the peak lr below with {c.warmup_steps} warm-up "
        f"steps and a cosine to {c.final_lr_fraction:g} of it at step {c.steps}, no "
        f"weight decay ({c.weight_decay:g}); the stable runs add "
        + ("QK-norm" if c.qk_norm else "no QK-norm")
        + (f" and z-loss {c.z_loss:g}" if c.z_loss else " (z-loss 0)")
        + (
            f", and skip loss spikes (skip_spikes: window {c.spike_window}, from "
            f"{c.spike_min_history} steps, {c.spike_threshold:g} robust sigmas)"
            if c.spike_guard
            else ", no spike guard"
        )
    )


def _corpus(config: Config):
    train, held, _ = data.load_corpus()
    if len(held) < config.seq_len + 2:
        raise ValueError(f"seq_len {config.seq_len} is longer than the held-out text")
    return train, held


def train_batches(config: Config) -> list[dict[str, np.ndarray]]:
    """The ``config.steps`` train batches: ``{"inputs", "targets"}`` int32 [B, T].

    Example:
        >>> b = train_batches(Config(batch_size=2, seq_len=8, steps=3))
        >>> len(b), b[0]["inputs"].shape, b[0]["inputs"].dtype.name
        (3, (2, 8), 'int32')
    """
    train, _ = _corpus(config)
    return [
        data.train_windows(train, step, batch=config.batch_size,
                           seq_len=config.seq_len, seed=config.seed)
        for step in range(config.steps)
    ]  # fmt: skip


def heldout_set(config: Config) -> dict[str, np.ndarray]:
    """``config.eval_images`` fixed held-out windows.

    Example:
        >>> heldout_set(Config(eval_images=4, seq_len=8))["targets"].shape
        (4, 8)
    """
    _, held = _corpus(config)
    return data.heldout_windows(
        held, windows=config.eval_images, seq_len=config.seq_len
    )


TASK = Task(
    name="lm",
    help="byte-level language model on Python's stdlib sources (bits per byte)",
    metrics=METRICS,
    config_class=Config,
    # a smoke run: the research's quick config (README.md): the naive
    # attention logits pass 100 by step ~8 there too; the bpb at 40 steps
    # does not separate the runs, the check points do
    quick=dict(
        width=64,
        seq_len=64,
        batch_size=8,
        steps=40,
        warmup_steps=10,
        eval_images=16,
        eval_batch_size=16,
    ),
    stable_loss="float32 softmax_cross_entropy, QK-norm in the attention",
    describe=describe,
    train_batches=train_batches,
    heldout_set=heldout_set,
    # imported when a run needs them (`compare.py --help` starts neither)
    initial_weights=own_part(__package__, "parts_torch.initial_weights"),
    jax_parts=own_part(__package__, "parts_jax.jax_parts"),
    torch_parts=own_part(__package__, "parts_torch.torch_parts"),
    check_config=check_config,
    precision="bfloat16",
    heldout_unit="windows",
    curves=(
        ("aux['attn_logit_max']", "max attention logit"),
        ("aux['attn_entropy_min']", "lowest head's attention entropy (nats)"),
        ("aux['log_z']", "mean log Z"),
    ),
    # The QK-norm scales' float32 gradients are ill-conditioned (each sums
    # 16 x 128 x 4 position terms that nearly cancel: a softmax backward row
    # sums to 0 and the keys share a common component): at the same weights
    # torch's own float32 gradient of blocks.1.attn.k_norm.scale is 2.9e-4
    # from float64 at step 12 of the default run, so 1e-4 would measure
    # float32, not the frameworks (README.md). The default config passes 50
    # steps at 1e-3 (max 1.4e-4, JAX vs torch).
    gradient_threshold=1e-3,
    diagnose=probe.diagnose,
    # the low-precision run set (`low_precision.py --out`), where there is one
    report_sections=own_part(__package__, "low_precision.report_section"),
)
