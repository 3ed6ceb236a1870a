"""The planner's data-parallel sizes are Megatron-core's own: its initialize_model_parallel (megatron-core
0.16, the installed GPU trainer) builds the rank groups on a fake world of N ranks (torch's `fake`
process-group backend: one process, no communication), and each group's size must be the planner's.

Dense DP = world / (TP x CP x PP); the distributed optimizer shards dense state over DP x CP (the ranks
Megatron's DDP reduces dense gradients in) and expert state over the expert-DP group world / (ETP x EP x
PP). With CP > 1 the context-parallel ranks join the expert-DP group: the planner used to divide DP by
EP there (world 32, CP 4, EP 8: expert-DP 1 instead of Megatron's 4, the expert optimizer x 4).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from rlslurm.modelspec import ModelConfig, param_counts
from rlslurm.plan.memory import MemoryConfig, resolve, trainer_memory
from rlslurm.plan.parallel import ParallelConfig, data_parallel, expert_data_parallel, world_rules

# (world, tp, pp, cp, ep, etp): the lecture's, CP with EP, TP x PP x CP, ETP != TP, and one Megatron refuses.
LAYOUTS = [(40, 1, 1, 1, 8, None), (32, 1, 1, 4, 8, None), (64, 2, 2, 2, 8, None), (16, 2, 1, 2, 4, 1),
           (48, 2, 1, 2, 4, None), (24, 1, 1, 2, 16, None)]

MEGATRON = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state as ps

    out = []
    for world, tp, pp, cp, ep, etp in json.loads(sys.argv[1]):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         context_parallel_size=cp, expert_model_parallel_size=ep,
                                         expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
            out.append({"dp": ps.get_data_parallel_world_size(),
                        "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
                        "expert_dp": ps.get_expert_data_parallel_world_size()})
            ps.destroy_model_parallel()
        except RuntimeError as e:
            out.append({"refused": str(e)})
        dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def megatron_groups() -> list[dict]:
    pytest.importorskip("megatron.core")
    done = subprocess.run([sys.executable, "-c", MEGATRON, json.dumps(LAYOUTS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(layout) for layout in LAYOUTS])
def test_group_sizes_are_megatrons(megatron_groups, index: int):
    world, tp, pp, cp, ep, etp = LAYOUTS[index]
    theirs = megatron_groups[index]
    p = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    if "refused" in theirs:
        assert world_rules(p, world), f"Megatron refuses {LAYOUTS[index]} ({theirs['refused']}); the plan does not"
        assert expert_data_parallel(p, world) == 0
        return
    assert not world_rules(p, world)
    assert data_parallel(p, world) == theirs["dp"]
    assert expert_data_parallel(p, world) == theirs["expert_dp"]
    # The memory the plan prints shards the optimizer over exactly those groups.
    model = ModelConfig(layers=4, heads=8, hidden=512, experts=16, topk=2)
    counts = param_counts(dataclasses.replace(model, expert_params_b=16.0, dense_params_b=1.0))
    mem = trainer_memory(counts, model, p, resolve(MemoryConfig(activation_gb=1.0), "megatron", "h100-80g"), 80.0,
                         dp=theirs["dp"])
    assert mem.expert_dp == theirs["expert_dp"]
    expert_per_gpu = 16e9 / (ep * (etp or tp) * pp)
    assert mem.expert_optimizer.value == pytest.approx(expert_per_gpu * 12 / theirs["expert_dp"] / 1e9)
    assert mem.dense_optimizer.value == pytest.approx(1e9 / (tp * pp) * 12 / theirs["dp_cp"] / 1e9)

