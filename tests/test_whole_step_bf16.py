"""--compile whole in bf16: the 16-bit weights the forward uses follow their fp32 masters (zerofunc/whole_step.py,
the update). tests/test_whole_step.py holds the step to eager in fp32, where the master is the weights."""
from __future__ import annotations

import pytest
import torch

from tests.bare import OPTIM, in_world
from tests.test_whole_step import CFG
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT
from zerofunc.stages import STAGES
from zerofunc.step import train_step


def _16_bit_weights_after_compiled_steps(stage: int):
    """Per compiled step (bf16 weights, fp32 masters, 2 ranks), for every unit: how far this rank's slot of
    the weights (all of them at stage 0, its shard at 3) is from its master rounded to bf16, and how far the
    whole weights are apart between the ranks (stages 1-2, which gather them after the update)."""
    import torch.distributed as dist
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "aot_eager"
    with torch.device("meta"):
        model = GPT(CFG)
    engine = ZeroEngine(model, STAGES[stage], DistCommunicator(link=None), OPTIM, precision="bf16",
                        init=lambda n, s: model.init_param(n, s, 0), compile="whole")
    g = torch.Generator().manual_seed(engine.comm.rank)
    rank, world, out = engine.comm.rank, engine.comm.world_size, []
    for _ in range(2):
        loss = train_step(engine, [[torch.randint(0, CFG.vocab_size, (2, 11), generator=g) for _ in range(2)]])
        for u in engine.units:
            n = u.master.numel()
            mine = u.params if stage in (0, 3) else u.params[rank * n:(rank + 1) * n]
            apart = torch.zeros(())
            if stage in (1, 2):
                every = [torch.empty_like(u.params) for _ in range(world)]
                dist.all_gather(every, u.params)
                apart = max((e.float() - u.params.float()).abs().max() for e in every)
            out.append((u.params.dtype, (mine.float() - u.master.to(torch.bfloat16).float()).abs().max().item(),
                        apart.item(), loss.item()))
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_compiled_whole_16_bit_weights_are_their_masters_rounded(stage):
    """bf16 training compiled whole: after every step each unit's 16-bit weights are its fp32 master
    rounded, exactly (a rounding, no arithmetic to reorder), and at stages 1-2 the same on every rank.
    Stage 0 and 3 copy the master into the weights (whole_step.py, "16-bit weights"), stage 1 gathers the
    rounded masters; a weight left unrefreshed is a step's update away from its master."""
    for dtype, from_master, apart, loss in (r for rank in in_world(2, _16_bit_weights_after_compiled_steps, stage)
                                            for r in rank):
        assert dtype == torch.bfloat16 and loss == loss
        assert from_master == 0.0, f"stage {stage}: weights {from_master:.1e} from their rounded master"
        assert apart == 0.0, f"stage {stage}: the ranks' weights differ by {apart:.1e}"
