"""PyTorch: public API of `torchref.diagnostics`.

Implementation in `torchref._src.diagnostics`.
"""

from torchref._src.diagnostics import LeafReport as LeafReport
from torchref._src.diagnostics import check_params as check_params
from torchref._src.diagnostics import format_report as format_report
from torchref._src.diagnostics import non_finite_grad_report as non_finite_grad_report
from torchref._src.diagnostics import non_finite_report as non_finite_report
