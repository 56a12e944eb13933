"""Experiment drivers built on the trainer: the report's numerics experiments, reproduced at small scale.

    branch.py   `hybridtron branch`: continue a checkpoint as trained and with every GEMM in BF16 (experiment 1)
"""
