"""PyTorch: public API of `torchref.loss_scale` (implementation in `torchref._src.loss_scale`)."""
