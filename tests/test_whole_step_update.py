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
