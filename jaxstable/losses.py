"""JAX: public API of `jaxstable.losses` (implementation in `jaxstable._src.losses`)."""

from jaxstable._src.linear_ce import linear_cross_entropy as linear_cross_entropy
from jaxstable._src.losses import (
    balanced_binary_cross_entropy as balanced_binary_cross_entropy,
)
from jaxstable._src.losses import box_iou_loss as box_iou_loss
from jaxstable._src.losses import db_loss as db_loss
from jaxstable._src.losses import db_step as db_step
from jaxstable._src.losses import dice_loss as dice_loss
from jaxstable._src.losses import info_nce as info_nce
from jaxstable._src.losses import masked_l1_loss as masked_l1_loss
from jaxstable._src.losses import (
    sigmoid_binary_cross_entropy as sigmoid_binary_cross_entropy,
)
from jaxstable._src.losses import sigmoid_focal_loss as sigmoid_focal_loss
from jaxstable._src.losses import softmax_cross_entropy as softmax_cross_entropy
