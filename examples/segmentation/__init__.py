"""Semantic segmentation example: synthetic data, a U-Net in Flax NNX and torch."""
