"""Scale-out on torch.distributed: plan a layout (`plan.py`, pure: config + cluster + workload -> ranked layouts
with memory and communication estimates; its cost model in `costs.py`), then build the mesh and apply it."""
