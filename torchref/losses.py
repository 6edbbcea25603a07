"""PyTorch: public API of `torchref.losses` (implemented in `torchref._src.losses`,
one module per family)."""

from torchref._src.losses.binary import (
    balanced_binary_cross_entropy as balanced_binary_cross_entropy,
)
from torchref._src.losses.binary import dice_loss as dice_loss
from torchref._src.losses.binary import (
    sigmoid_binary_cross_entropy as sigmoid_binary_cross_entropy,
)
from torchref._src.losses.binary import sigmoid_focal_loss as sigmoid_focal_loss
from torchref._src.losses.boxes import box_iou_loss as box_iou_loss
from torchref._src.losses.contrastive import info_nce as info_nce
from torchref._src.losses.cross_entropy import (
    softmax_cross_entropy as softmax_cross_entropy,
)
from torchref._src.losses.dbnet import db_loss as db_loss
from torchref._src.losses.dbnet import db_step as db_step
from torchref._src.losses.regression import masked_l1_loss as masked_l1_loss
