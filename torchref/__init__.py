"""torchref: the PyTorch twin of jaxstable, module for module, name for name.

Built on what careful PyTorch users already use (`F.cross_entropy`,
`torch.amp.GradScaler`, `torch.autocast`, `clip_grad_norm_`); it never
re-implements them. This package never imports jax.
"""

from torchref import diagnostics as diagnostics
from torchref import loss_scale as loss_scale
from torchref import losses as losses
from torchref import precision as precision
from torchref import train as train
from torchref import transforms as transforms

__version__ = "0.1.0"
