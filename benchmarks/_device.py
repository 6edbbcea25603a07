"""What the benchmarks write about the machine they ran on (every script).

`cpu_name` lives once, in `examples.harness.environment` (the harness
records it in every ``summary.json``); this module keeps the scripts'
``from _device import cpu_name`` working when run as
``python benchmarks/bench_*.py`` (only ``benchmarks/`` on ``sys.path``).
That module imports neither JAX nor torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.harness.environment import cpu_name  # noqa: E402

__all__ = ["cpu_name"]
