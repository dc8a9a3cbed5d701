"""--compile whole, stages 1-2's update through inductor on gloo's ops: each unit's new weights gathered by
broadcasts straight into the weights (zerofunc/broadcast_gather.py, `broadcast_gather_into`), as the eager
step gathers them, not into a fresh buffer copied over them (at 120m, 480 MB a rank written twice a step
more, and a fresh buffer's pages). tests/test_whole_step.py holds the update to eager through aot_eager, which
runs the functionalized op on a copy: only inductor's reinplacing writes the weights themselves."""
from __future__ import annotations

import pytest

from tests.bare import in_world


def _stage_2_under_inductor_with_the_stand_ins():
    import zerofunc.broadcast_gather
    from tests.test_whole_step import eager_and_whole_with_the_stand_ins
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "inductor"
    written, real = [], zerofunc.broadcast_gather._broadcast_slots

    def broadcast_slots(whole, shard, group_name):
        written.append(whole.data_ptr())
        real(whole, shard, group_name)

    zerofunc.broadcast_gather._broadcast_slots = broadcast_slots
    whole, loss_err, param_err = eager_and_whole_with_the_stand_ins(2)
    weights = {u.params.data_ptr() for u in whole.units}
    return loss_err, param_err, len(written), sum(1 for p in written if p in weights)


@pytest.mark.slow
def test_stage_2_s_update_compiled_by_inductor_gathers_into_the_weights():
    """On 2 gloo ranks, 3 steps of stage 2 with the eager step's gloo ops (each block's gather as broadcasts):
    the compiled step trains like eager within tests/test_whole_step.py's derived 1e-5, and every gather of
    its updates writes a unit's weights themselves (tests/plants.py: whole_step_update_gathers_into_a_copy)."""
    for loss_err, param_err, gathers, into_weights in in_world(2, _stage_2_under_inductor_with_the_stand_ins):
        assert loss_err <= 1e-5, f"losses differ by {loss_err:.1e}"
        assert param_err <= 1e-5, f"parameters differ by {param_err:.1e}"
        assert gathers > 0, "no unit's update was gathered by broadcasts: the case this test is for is gone"
        assert into_weights == gathers, f"{gathers - into_weights} of {gathers} gathers wrote a buffer, not the weights"


def _stages_0_and_1_reduce_graphs_under_inductor():
    import re

    from torch._inductor.utils import run_and_get_code

    from tests.test_whole_step import eager_and_whole_with_the_stand_ins  # stage 1 scatters by all-reduce
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "inductor"
    out = []
    for stage in (0, 1):
        (whole, loss_err, param_err), code = run_and_get_code(eager_and_whole_with_the_stand_ins, stage)
        # the reduce graph: the one that takes the gradients' norm; each all-reduce issued on what it reduces
        reduce = [c for c in code if "vector_norm" in c]
        reduced_on = [m.group(1) for c in reduce
                      for m in re.finditer(r"_c10d_functional\.all_reduce_\.default\((\w+)", c)]
        out.append((stage, loss_err, param_err, len(reduce), len(whole.whole.trained),
                    sum(1 for b in reduced_on if re.fullmatch(r"arg\d+_\d+", b))))
    return out


@pytest.mark.slow
def test_stages_0_and_1_reduce_each_gradient_where_it_lies():
    """Stages 0-1 on a CPU reduce after backward, in the reduce graph, whose inputs are the gradients. Funcol's
    all-reduce copies its input first; each gradient is instead written with its sum (collectives.reduced_into),
    which inductor issues as c10d's in-place all-reduce on the graph's input: one copy of every gradient less a
    step (30m: 120 MB written, and a transient buffer of that size), as the eager step reduces in place. On 2
    gloo ranks, 3 steps with stage 1's reduce-scatter as an all-reduce (gloo's stand-in): trains like eager
    within tests/test_whole_step.py's derived 1e-5, and the reduce graph's code all-reduces each unit's
    gradient on an input buffer (`argN_1`), not on a copy (`bufN`) (tests/plants.py:
    whole_step_reduces_a_copy_of_each_gradient)."""
    for stage, loss_err, param_err, graphs, units, in_place in in_world(2, _stages_0_and_1_reduce_graphs_under_inductor)[0]:
        assert loss_err <= 1e-5, f"stage {stage}: losses differ by {loss_err:.1e}"
        assert param_err <= 1e-5, f"stage {stage}: parameters differ by {param_err:.1e}"
        assert graphs == 1, f"stage {stage}: {graphs} graphs take a norm, where the reduce graph is one"
        assert in_place == units, f"stage {stage}: {units - in_place} of {units} gradients reduced on a copy"
