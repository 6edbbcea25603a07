"""The framework-free checks of the losses' string options."""

from __future__ import annotations

REDUCTIONS = ("mean", "sum", "none")
BOX_KINDS = ("iou", "giou", "diou", "ciou")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"unknown reduction {reduction!r}; valid values: {', '.join(REDUCTIONS)}"
        )


def check_kind(kind: str) -> None:
    if kind not in BOX_KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid values: {', '.join(BOX_KINDS)}")
