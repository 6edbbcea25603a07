"""PyTorch: public API of `torchref.losses` (implementation in `torchref._src.losses`)."""
