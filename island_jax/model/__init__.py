"""The model: a decoder-only transformer whose feed-forward layers are expert-parallel MoE."""
