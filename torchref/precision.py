"""PyTorch: public API of `torchref.precision` (implementation in `torchref._src.precision`)."""
