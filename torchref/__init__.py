"""torchref: the PyTorch twin of jaxstable, module for module, name for name.

Built on what careful PyTorch users already use (`F.cross_entropy`,
`torch.amp.GradScaler`, `torch.autocast`, `clip_grad_norm_`); it never
re-implements them. This package never imports jax.
"""

from _stablecore import __version__ as __version__

# `pip install jaxstable` installs neither framework: each camp comes with its
# extra (CONTRIBUTING.md, "Packaging"). Name the extra when the camp is absent.
_CAMP = ("torch", "numpy")

try:
    from torchref import diagnostics as diagnostics
    from torchref import loss_scale as loss_scale
    from torchref import losses as losses
    from torchref import precision as precision
    from torchref import train as train
    from torchref import transforms as transforms
except ModuleNotFoundError as err:
    if (err.name or "").split(".")[0] not in _CAMP:
        raise
    raise ModuleNotFoundError(
        f"torchref needs {err.name!r}, which is not installed: "
        'pip install "jaxstable[torch]" installs the PyTorch camp (torch)',
        name=err.name,
    ) from err
