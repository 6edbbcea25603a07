"""The check points of the language-model runs and the diagnosis drawn from them.

Both losses return the points of :data:`CHECKS` as ``aux`` (`loss_jax`,
`loss_torch`); `fit` writes them into every record as ``aux[...]`` keys.
:func:`run_checks` reads one run's records back into a few numbers (when
the attention logits grew past ``config.attention_logit_limit``, when the
lowest head's attention entropy fell below ``config.entropy_floor``, how
far log Z moved, the first loss spike), :func:`mechanism` names what they
show, and :func:`diagnose` writes the report's section and the summary's
``diagnosis`` from them: nothing in the text is decided before the runs.
"""

from __future__ import annotations

import math
from typing import Any

# The check points of both losses, in `aux` (`fit` records: aux['<name>']).
CHECKS = ("ce", "log_z", "log_z_abs_max", "attn_logit_max", "attn_entropy_min")
# A loss spike: the train cross-entropy more than SPIKE_JUMP nats above the
# minimum of the SPIKE_WINDOW steps before it (a 1-nat jump is e-fold worse
# prediction of every byte).
SPIKE_JUMP = 1.0
SPIKE_WINDOW = 20
ATTENTION = "attention-logit growth"
OUTPUT = "output-logit divergence"
NON_FINITE = "non-finite values"


def _series(records, name: str) -> list[float]:
    return [float(r.get(f"aux[{name!r}]", math.nan)) for r in records]


def _first(values, test) -> int | None:
    return next((i for i, v in enumerate(values) if test(v)), None)


def spike_step(ce: list[float]) -> int | None:
    """The first step whose CE is SPIKE_JUMP above the last SPIKE_WINDOW's minimum.

    Example:
        >>> spike_step([3.0] * 25 + [4.5, 3.0])
        25
        >>> spike_step([3.0] * 25 + [3.9]) is None
        True
    """
    for i in range(SPIKE_WINDOW, len(ce)):
        lo = min(ce[i - SPIKE_WINDOW : i])
        if math.isfinite(ce[i]) and math.isfinite(lo) and ce[i] > lo + SPIKE_JUMP:
            return i
    return None


def run_checks(records: list[dict[str, Any]], config) -> dict[str, Any]:
    """The numbers of one run's check points (JSON-ready).

    Keys: ``attn_logit_first`` (step 0), ``attn_logit_peak`` and
    ``attn_logit_peak_step``, ``attn_logit_over_limit_step`` (the first step
    past ``config.attention_logit_limit``, or None), ``entropy_collapse_step``
    (first below ``config.entropy_floor``), ``entropy_min_after_warmup``,
    ``entropy_final``, ``log_z_min`` / ``log_z_max`` (of the batch mean),
    ``log_z_abs_max`` (one position's), ``spike_step``, ``spike_skips``
    (the steps the spike guard skipped: `fit`'s ``skip_reason`` "spike";
    0 for a run without the guard). Non-finite values are left out of the
    extremes (None when there is none).

    Example:
        >>> from examples.lm.config import Config
        >>> recs = [{"aux['attn_logit_max']": a, "aux['attn_entropy_min']": e,
        ...          "aux['log_z']": 5.5, "aux['log_z_abs_max']": 6.0, "aux['ce']": 3.0}
        ...         for a, e in ((0.3, 2.0), (150.0, 0.05), (2e4, 0.0))]
        >>> c = run_checks(recs, Config(warmup_steps=1))
        >>> c["attn_logit_over_limit_step"], c["entropy_collapse_step"]
        (1, 1)
        >>> c["attn_logit_peak"], c["attn_logit_peak_step"]
        (20000.0, 2)
    """
    attn = _series(records, "attn_logit_max")
    ent = _series(records, "attn_entropy_min")
    log_z = _series(records, "log_z")
    finite = lambda xs: [x for x in xs if math.isfinite(x)]  # noqa: E731
    peak = max(finite(attn), default=None)
    after = finite(ent[config.warmup_steps :]) or finite(ent)
    return {
        "attn_logit_first": attn[0] if attn and math.isfinite(attn[0]) else None,
        "attn_logit_peak": peak,
        "attn_logit_peak_step": None if peak is None else attn.index(peak),
        "attn_logit_over_limit_step": _first(
            attn, lambda v: v > config.attention_logit_limit
        ),
        "entropy_collapse_step": _first(ent, lambda v: v < config.entropy_floor),
        "entropy_min_after_warmup": min(after, default=None),
        "entropy_final": ent[-1] if ent and math.isfinite(ent[-1]) else None,
        "log_z_min": min(finite(log_z), default=None),
        "log_z_max": max(finite(log_z), default=None),
        "log_z_abs_max": max(finite(_series(records, "log_z_abs_max")), default=None),
        "spike_step": spike_step(_series(records, "ce")),
        "spike_skips": [r["step"] for r in records if r.get("skip_reason") == "spike"],
    }


def mechanism(checks: dict[str, Any], config, nonfinite_step=None) -> str | None:
    """What the check points show went wrong, or None.

    :data:`ATTENTION` when the attention logits passed the limit,
    :data:`OUTPUT` when the mean log Z left ``[-log_z_limit, log_z_limit]``
    (both may hold: joined by " and "), :data:`NON_FINITE` when only the
    model broke, None when the run shows none of them.

    Example:
        >>> from examples.lm.config import Config
        >>> mechanism({"attn_logit_over_limit_step": 9, "log_z_min": 5.0,
        ...            "log_z_max": 6.0}, Config())
        'attention-logit growth'
        >>> mechanism({"attn_logit_over_limit_step": None, "log_z_min": 5.0,
        ...            "log_z_max": 60.0}, Config())
        'output-logit divergence'
    """
    found = []
    if checks["attn_logit_over_limit_step"] is not None:
        found.append(ATTENTION)
    lo, hi = checks["log_z_min"], checks["log_z_max"]
    if lo is not None and max(abs(lo), abs(hi)) > config.log_z_limit:
        found.append(OUTPUT)
    if not found and nonfinite_step is not None:
        found.append(NON_FINITE)
    return " and ".join(found) or None


def cause_note(aux: dict[str, float], config) -> str:
    """The check points of a naive run's first non-finite step, in one line.

    Args:
      aux: the check points of the naive loss on that step's batch, from the
        weights before it (floats).
      config: the run's config (its limits).

    Example:
        >>> from examples.lm.config import Config
        >>> print(cause_note({"ce": 2.0, "log_z": 5.5, "log_z_abs_max": 9.0,
        ...                   "attn_logit_max": 7e4, "attn_entropy_min": 0.0},
        ...                  Config(precision="float16")))
        ... # doctest: +NORMALIZE_WHITESPACE
        Cause observed: max attention logit 7e+04 (limit 100; float16's
        largest finite value is 65504), lowest head's attention entropy 0.000
        nats, mean log Z 5.50 (max |log Z| 9), train CE 2.000.
    """
    limit = ""
    if config.precision == "float16":
        limit = "; float16's largest finite value is 65504"
    return (
        f"Cause observed: max attention logit {aux['attn_logit_max']:.3g} (limit "
        f"{config.attention_logit_limit:g}{limit}), lowest head's attention entropy "
        f"{aux['attn_entropy_min']:.3f} nats, mean log Z {aux['log_z']:.2f} (max "
        f"|log Z| {aux['log_z_abs_max']:.3g}), train CE {aux['ce']:.3f}."
    )


def _g(x, spec=".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _step(x) -> str:
    return "-" if x is None else str(x)


def _table(rows) -> list[str]:
    out = [
        "| run | failure seen | max attention logit (step 0 -> peak @ step) | "
        "> limit @ | entropy < floor @ | min entropy after warm-up | mean log Z "
        "range | CE spike @ | spike skips | held-out bpb | vs float32 |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        c = r["checks"]
        out.append(
            f"| {r['run']} | {r['failure'] or 'none'} | {_g(c['attn_logit_first'])} -> "
            f"{_g(c['attn_logit_peak'])} @ {_step(c['attn_logit_peak_step'])} | "
            f"{_step(c['attn_logit_over_limit_step'])} | "
            f"{_step(c['entropy_collapse_step'])} | "
            f"{_g(c['entropy_min_after_warmup'], '.2f')} | "
            f"{_g(c['log_z_min'], '.2f')} .. {_g(c['log_z_max'], '.2f')} | "
            f"{_step(c['spike_step'])} | {len(c['spike_skips'])} | "
            f"{_g(r['bits_per_byte'], '.3f')} | "
            f"{_g(r['vs_float32'], '+.1%')} |"
        )
    return out


def _sentence(r: dict[str, Any], config) -> str:
    c = r["checks"]
    name = f"**{r['run']}**"
    if r["failure"] is None:
        return (
            f"- {name}: no failure in the check points: the max attention logit "
            f"peaked at {_g(c['attn_logit_peak'])} (limit "
            f"{config.attention_logit_limit:g}), the lowest head's attention "
            f"entropy stayed at or above {_g(c['entropy_min_after_warmup'], '.2f')} "
            f"nats after warm-up, the mean log Z within {_g(c['log_z_min'], '.2f')}"
            f"..{_g(c['log_z_max'], '.2f')}." + _skips(c["spike_skips"])
        )
    text = f"- {name}: **{r['failure']}**."
    if c["attn_logit_over_limit_step"] is not None:
        text += (
            f" The max attention logit |q.k|/sqrt(d_head) went from "
            f"{_g(c['attn_logit_first'])} at step 0 past "
            f"{config.attention_logit_limit:g} at step "
            f"{c['attn_logit_over_limit_step']} and peaked at "
            f"{_g(c['attn_logit_peak'])} (step {c['attn_logit_peak_step']})"
        )
        if c["entropy_collapse_step"] is not None:
            text += (
                f"; the lowest head's attention entropy fell below "
                f"{config.entropy_floor:g} nats at step {c['entropy_collapse_step']} "
                f"(one-hot attention) and ended at {_g(c['entropy_final'], '.2f')}"
            )
        text += "."
    lo, hi = c["log_z_min"], c["log_z_max"]
    if lo is not None and OUTPUT not in r["failure"]:
        text += (
            f" The mean log Z stayed within {lo:.2f}..{hi:.2f} (limit "
            f"{config.log_z_limit:g}): the output logits did not diverge."
        )
    elif lo is not None:
        text += f" The mean log Z ranged over {lo:.2f}..{hi:.2f}."
    if c["spike_step"] is not None:
        text += f" First loss spike (CE > {SPIKE_JUMP:g} nat above the last "
        text += f"{SPIKE_WINDOW} steps' minimum) at step {c['spike_step']}."
    if r["vs_float32"] is not None:
        text += f" Held-out bits per byte {r['vs_float32']:+.1%} vs its float32 run."
    return text + _skips(c["spike_skips"])


def _skips(steps: list[int]) -> str:
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    return f" The spike guard skipped {len(steps)} step(s): {shown}."


def diagnose(runs: list) -> dict[str, Any]:
    """The ``diagnosis`` of a comparison: per run its check numbers and the
    failure they show, and the report's text (a table and one line per run).

    Args:
      runs: the comparison's `RunResult` s (their records carry the check
        points as ``aux[...]`` keys).

    Returns:
      ``{"runs": [{"run", "failure", "checks", "bits_per_byte",
      "vs_float32"}], "text": markdown}``.
    """
    ref = {
        r.framework: r.scores.get("bits_per_byte")
        for r in runs
        if r.config.precision == "float32" and r.config.mode == "stable"
    }
    rows = []
    for r in runs:
        checks = run_checks(r.metrics, r.config)
        bpb = r.scores.get("bits_per_byte")
        base = ref.get(r.framework)
        gap = None
        if (
            base
            and bpb is not None
            and math.isfinite(bpb)
            and r.config.precision != "float32"
        ):
            gap = bpb / base - 1
        rows.append({
            "run": r.name,
            "failure": mechanism(checks, r.config, r.first_nonfinite_step),
            "checks": checks,
            "bits_per_byte": bpb if bpb is not None and math.isfinite(bpb) else None,
            "vs_float32": gap,
        })  # fmt: skip
    config = runs[0].config
    text = [
        "## What the check points show",
        "",
        "Measured in every step by the loss (`aux[...]` in metrics.jsonl): the max "
        "attention logit |q.k|/sqrt(d_head) over the layers, the lowest head's mean "
        "attention entropy (nats; ln T when uniform, 0 when one-hot) and the mean "
        "log Z of the output softmax. Limits: attention logit "
        f"{config.attention_logit_limit:g}, entropy {config.entropy_floor:g} nats, "
        f"|mean log Z| {config.log_z_limit:g}.",
        "",
        *_table(rows),
        "",
        *(_sentence(r, config) for r in rows),
        "",
    ]
    naive = [r for r in rows if r["run"].endswith("naive")]
    stable = [r for r in rows if not r["run"].endswith("naive")]
    seen = sorted({r["failure"] for r in naive if r["failure"]})
    if seen:
        cured = [r for r in stable if r["failure"] is None]
        text.append(
            f"Diagnosis: the naive runs failed by {' and '.join(seen)} "
            f"({sum(r['failure'] is not None for r in naive)} of {len(naive)}); "
            f"{len(cured)} of {len(stable)} stable runs show no failure in their "
            "check points."
        )
    else:
        text.append("Diagnosis: no naive run shows a failure in its check points.")
    return {"runs": rows, "text": "\n".join(text) + "\n"}
