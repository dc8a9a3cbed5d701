"""--compile: each block's compute through torch.compile trains as the eager engine does."""
from __future__ import annotations

import torch

from tests.test_equivalence import OPTIM  # lr and eps chosen there so Adam does not amplify rounding
from tests.worlds import in_world
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT, GPTConfig
from zerofunc.stages import STAGES

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=24, vocab_size=40, block_size=16)
STEPS = 3


def _train(stage: int, compile: bool):
    with torch.device("meta"):
        model = GPT(CFG)
    engine = ZeroEngine(model, STAGES[stage], DistCommunicator(), OPTIM,
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile)
    g = torch.Generator().manual_seed(engine.comm.rank)
    losses = []
    for _ in range(STEPS):
        x, y = (torch.randint(0, CFG.vocab_size, (2, 12), generator=g) for _ in range(2))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_parameters()


def _compare_stages():
    from torch._dynamo.utils import counters
    out = {}
    for stage in STAGES:
        eager_losses, eager = _train(stage, compile=False)
        compiled_losses, compiled = _train(stage, compile=True)
        loss_err = max(abs(a - b) / abs(a) for a, b in zip(eager_losses, compiled_losses))
        param_err = max(((compiled[n] - eager[n]).norm() / eager[n].norm()).item() for n in eager)
        out[stage] = (loss_err, param_err)
    # one graph serves every block (no per-block constant), so a deep model does not recompile per block
    return out, counters["stats"]["unique_graphs"]


def test_compiled_blocks_train_like_eager():
    for per_stage, graphs in in_world(2, _compare_stages):
        for stage, (loss_err, param_err) in per_stage.items():
            assert loss_err <= 1e-5, f"stage {stage}: losses differ by {loss_err:.1e}"
            assert param_err <= 1e-5, f"stage {stage}: parameters differ by {param_err:.1e}"
        assert graphs == 1
