"""Framework-free logic shared by `jaxstable` and `torchref` (private).

The two libraries may not import each other (jaxstable never imports torch,
torchref never imports jax), but much of what they do is plain Python: the
NaN-policy bookkeeping and the JSONL log of `fit`, the checkpoint directory's
lock, option validators, the texts of reports and errors. That code lives
here once and both packages import it, so the twins cannot drift apart.

Rules (tests/test_layout.py checks them): the standard library only (no jax,
torch or numpy); no public API (users import `jaxstable` or `torchref`,
whose modules re-export what they need under their own names and keep the
docstrings with examples in their framework).
"""

# The release's version, the one place it is written: pyproject.toml reads it
# (setuptools' dynamic version) and both packages re-export it.
__version__ = "0.1.0"
