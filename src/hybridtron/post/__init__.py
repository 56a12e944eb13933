"""Post-training: algorithms that start from a pretrained checkpoint (MTP boosting, `mtp_boost.py`)."""
