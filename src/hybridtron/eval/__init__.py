"""Evaluation, one implementation for every stage and command: a policy's pass@k on an environment's held-out tasks
(`tasks.py`), the held-out cross entropy of conversations by domain (`conversations.py`, over the trainer's own
`hybridtron.train.evaluate.held_out_ce`), and the `hybridtron eval` command (`command.py`)."""
