"""``compare.py --devices N``: JAX's devices, and how N-device runs are checked.

JAX runs data parallel on a mesh of N devices (:func:`jax_distribute`); on
a CPU machine those are forced host devices (:func:`force_host_devices`,
called by the CLI before JAX starts). Each N-device run gets a replica check
(:func:`replica_check`), and the plan can be compared with its 1-device run
(:func:`one_device_agreement`, :func:`devices_report`). The torch side, N
DDP processes, is `examples.harness.ddp`.
"""

from __future__ import annotations

import math
import os
from typing import Any

from examples.harness.config import BaseConfig
from examples.harness.results import RunResult, fmt, json_float


def force_host_devices(n: int) -> None:
    """Makes JAX see `n` devices: ``n`` forced host CPU devices on a CPU box.

    Adds ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS``, which
    XLA reads once, when JAX starts its CPU backend: `main` calls this right
    after parsing the command line, before any JAX computation (no re-exec).
    With GPUs (or TPUs) JAX's devices are the accelerators, the flag does not
    touch them, and the mesh takes the first `n` real devices.

    Raises:
      RuntimeError: JAX has fewer than `n` devices (its backend had already
        started in this process with fewer, or there are fewer accelerators).

    Example:
        >>> force_host_devices(1)  # one device: nothing to do
    """
    if n <= 1:
        return
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
    # Each forced device runs its part of a step on a thread of the CPU
    # client's pool, as many threads as cores unless PJRT_NPROC says
    # otherwise; the parts meet in every all-reduce, so with fewer threads
    # than devices one part may never start (4 devices on 2 cores: XLA
    # aborted after 40 s, jaxstable/tests/test_distributed.py).
    os.environ.setdefault("PJRT_NPROC", str(max(2 * n, os.cpu_count() or 1)))
    import jax

    have = jax.device_count()
    if have < n:
        raise RuntimeError(
            f"--devices {n} needs {n} JAX devices, but JAX has {have} "
            f"({jax.default_backend()}): XLA_FLAGS is read once per process, "
            "so run compare.py in a fresh process (or on a machine with that "
            "many accelerators)"
        )


def jax_distribute(config: BaseConfig, state: Any, batches: list) -> tuple[Any, list]:
    """``(state, batches)`` placed data parallel on ``config.devices`` devices.

    The state (a `TrainState` or the naive step's dict) is replicated, each
    GLOBAL batch split along its rows (`jaxstable.distributed.shard_state`
    / `shard_batch`): the jitted step then computes the 1-device run's
    losses, batch statistics and gradients as one SPMD program. One device:
    both returned as they are.

    Example:
        >>> state, batches = jax_distribute(BaseConfig(), {"w": 1.0}, [])
        >>> state, batches
        ({'w': 1.0}, [])
    """
    if config.devices == 1:
        return state, batches
    from jaxstable import distributed

    mesh = distributed.make_mesh(config.devices)
    state = distributed.shard_state(state, mesh, "data_parallel")
    return state, [distributed.shard_batch(b, mesh) for b in batches]


def replica_check(devices: int, identical: bool, histories: list) -> dict[str, Any]:
    """``replicas`` of a `RunResult`: did every replica decide alike?

    Args:
      devices: the device (JAX) or process (torch) count.
      identical: every copy of the final model is bitwise equal
        (`replicas_identical` of the framework's ``distributed`` module).
      histories: the `fit` records of every rank (JAX: one, the program is
        one SPMD program).

    Returns:
      ``{"devices", "replicas_identical", "ranks_agree"}``; ``ranks_agree``:
      every rank recorded the same ``finite``, ``skipped_total`` and
      ``loss_scale`` at every step (the skip decisions).

    Example:
        >>> h = [{"finite": True, "skipped_total": 0, "loss_scale": 2.0}]
        >>> replica_check(2, True, [h, h])["ranks_agree"]
        True
    """
    keys = ("finite", "skipped_total", "loss_scale")
    decisions = [[tuple(r[k] for k in keys) for r in h] for h in histories]
    return {
        "devices": devices,
        "replicas_identical": bool(identical),
        "ranks_agree": all(d == decisions[0] for d in decisions),
    }


def one_device_agreement(runs: list[RunResult], refs: list[RunResult]) -> list[dict]:
    """Each N-device run against the same run on one device.

    Per run: ``max_rel_loss_diff`` (max |loss_N - loss_1| / |loss_1| over
    the steps where both losses are finite; NaN when the step counts differ,
    a loss is non-finite in one run only, or a loss is zero),
    ``same_decisions`` (``finite``, ``skipped_total``
    and ``loss_scale`` equal at every step) and both held-out headline
    scores.

    Example:
        >>> rec = lambda l: {"loss": l, "finite": True, "skipped_total": 0,
        ...                  "loss_scale": 1.0}
        >>> mk = lambda l: RunResult(
        ...     "jax", BaseConfig(), [rec(l)], None, l, 0, {"miou": 0.5}, 1.0)
        >>> a = one_device_agreement([mk(1.0001)], [mk(1.0)])[0]
        >>> round(a["max_rel_loss_diff"], 6), a["same_decisions"]
        (0.0001, True)
    """
    keys = ("finite", "skipped_total", "loss_scale")
    rows = []
    for r, ref in zip(runs, refs, strict=True):
        diff = _rel_loss_diff(
            [m["loss"] for m in r.metrics], [m["loss"] for m in ref.metrics]
        )
        same = [tuple(m[k] for k in keys) for m in r.metrics] == [
            tuple(m[k] for k in keys) for m in ref.metrics
        ]
        key = next(iter(r.scores), None)
        rows.append(
            {
                "run": r.name,
                "max_rel_loss_diff": json_float(diff),
                "same_decisions": same,
                "score": None if key is None else json_float(r.scores[key]),
                "score_1_device": None if key is None else json_float(ref.scores[key]),
            }
        )
    return rows


def _rel_loss_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or [math.isfinite(x) for x in a] != [
        math.isfinite(y) for y in b
    ]:
        return math.nan
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(y)]
    if any(y == 0 for _, y in pairs):
        return math.nan
    return max((abs(x - y) / abs(y) for x, y in pairs), default=0.0)


def devices_report(summary: dict[str, Any]) -> list[str]:
    """The "N devices" section of ``report.md`` (nothing on one device).

    Example:
        >>> devices_report({"config": {"devices": 1}, "runs": []})
        []
        >>> devices_report({"config": {"devices": 2}, "runs": []})[0]
        '## 2 devices'
    """
    n = summary.get("config", {}).get("devices", 1)  # a summary may omit config
    if n <= 1:
        return []
    lines = [
        f"## {n} devices",
        "",
        f"Every run is data parallel over {n} devices: JAX on a mesh of {n} "
        f"devices (forced host CPU devices on a CPU machine), torch in {n} DDP "
        "processes (gloo); each replica trains on its rows of the same global batches. "
        "A replica check per run: every rank took the same skip decisions "
        "(finite, skipped_total, loss scale at every step) and every copy of "
        "the final model is bitwise identical.",
        "",
        "| run | ranks agree | replicas identical |",
        "|---|---|---|",
    ]
    for r in summary["runs"]:
        rep_ = r.get("replicas", {})
        lines.append(
            f"| {r['framework']} {r['precision']} {r['mode']} | "
            f"{rep_.get('ranks_agree')} | {rep_.get('replicas_identical')} |"
        )
    agreement = summary.get("one_device")
    if agreement:
        lines += [
            "",
            "Agreement with 1 device (the same runs on one device / one "
            "process, `--one-device-reference`):",
            "",
            "| run | max relative loss difference | same skip decisions | "
            "held-out score | on 1 device |",
            "|---|---|---|---|---|",
        ]
        for a in agreement:
            lines.append(
                f"| {a['run']} | {fmt(a['max_rel_loss_diff'], '.2e')} | "
                f"{a['same_decisions']} | {fmt(a['score'], '.3f')} | "
                f"{fmt(a['score_1_device'], '.3f')} |"
            )
    return [*lines, ""]
