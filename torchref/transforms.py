"""PyTorch: public API of `torchref.transforms` (implementation in `torchref._src.transforms`)."""
