"""fit's keywords of the old form in the new one, for tests that count the
warnings fit gives (the old form adds a DeprecationWarning)."""

from __future__ import annotations


def new_form(train, folder, kw: dict) -> dict:
    """`kw` with checkpoint_dir (default ``folder / "ck"``), checkpoint_every,
    resume, log_path and progress as `train.Checkpointing` and `train.Log`;
    a run without a directory keeps the old keywords (fit refuses them as
    before)."""
    kw = {"checkpoint_dir": folder / "ck", **kw}
    ck = kw.pop("checkpoint_dir")
    every, resume = kw.pop("checkpoint_every", None), kw.pop("resume", False)
    if ck is not None:
        kw["checkpoint"] = train.Checkpointing(ck, every=every, resume=resume)
    elif every is not None or resume:
        kw.update(checkpoint_dir=None, checkpoint_every=every, resume=resume)
    kw["log"] = train.Log(kw.pop("log_path", None), progress=False)
    return kw
