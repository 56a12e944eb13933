"""Pretraining: the loop, its hooks (metrics, validation, checkpoints, stability), schedule and balancing."""
