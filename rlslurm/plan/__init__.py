"""The planner behind `rlslurm plan`: arithmetic before asking for GPUs.

    hardware.py  GPUs, links, filesystem          memory.py      trainer memory per GPU, verdicts
    parallel.py  layout and divisibility rules     splits.py      train/rollout splits, the advice
    placement.py colocate vs. separate, offload    decode.py      KV cache, capacity, decode roofline
    steptime.py  sync, reward, step split          checkpoint_interval.py  Young / Daly
    recompute.py recompute's cost in step time     options.py     each placement x split x sync: step, blockers
    quantity.py  a number with its terms           report.py      build_plan (the choice), preflight; render.py
"""
