"""Scale-out on torch.distributed: plan a layout, then build the meshes and apply it (docs/SCALE.md).

    layout.py                       a layout's degrees, the workload, the structural rules every check shares
    plan.py, costs.py, serving.py   the planner: pure, config + cluster + workload -> ranked layouts, memory, comms
    config.py                       the `[dist]` section (DistConfig)
    mesh.py                         the layout checked with the planner's rules, the process groups, the meshes
    parallelize.py                  PP -> TP -> EP -> activation checkpointing -> compile -> FSDP2, in that order
    tensor_parallel.py              TP with sequence parallelism (attention, Mamba-2, MLPs, embedding, lm_head)
    expert_parallel.py              EP: dropless all-to-all dispatch, or capacity-factor dropping
    pipeline.py                     PP with torch.distributed.pipelining (1F1B, interleaved 1F1B, GPipe)
    step.py                         data-parallel rows, norms of sharded gradients, metrics over ranks, gathering
    state.py                        DCP checkpoint state in the single-process layout (resumes at any world size)
    convert.py                      `hybridtron convert`: sharded checkpoint <-> HF
"""
