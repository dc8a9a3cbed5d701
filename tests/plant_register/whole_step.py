"""The plant register: the step compiled whole (zerofunc/whole_step.py, zerofunc/compiled_graphs.py)."""
from __future__ import annotations

from tests.plant_register.common import Plant

PLANTS: list[Plant] = [
    Plant("whole_step_sum_not_averaged", "zerofunc/whole_step.py",
          "            g = g / self.world  #", "            g = g  #",
          "the compiled step's collectives sum the ranks' gradients and nothing divides the sum: every stage "
          "compiled whole trains with N times the gradient",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager",)),
    Plant("whole_step_bucket_cap_ignored", "zerofunc/compiled_graphs.py",
          "            bucketing.bucket_all_gather(graph.owning_module, cap_mb)\n",
          "            bucketing.bucket_all_gather(graph.owning_module)\n",
          "the compiled step buckets gathers at inductor's default cap (2000 MB): stage 3 gathers the whole model "
          "at once, undoing ZeRO-3's memory",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_one_gathered_block",)),
]
