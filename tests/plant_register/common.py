"""What every part of the register shares: the entry's shape, and the files and tests many entries name.

Each entry names a file, a piece of code that must occur in it exactly once (`old`) and what replaces it
(`new`); a bug that spans two places carries its further (file, old, new) edits in `also`. A selection is
pytest arguments: node ids, files, `-k` and `-m` expressions. The fast tier (`-m "not slow"`) is
preferred; a slow test is named only where no fast test can catch the bug.

Sources: "issue N note" is a closing note of issue N (`issues stops`); "TESTS.md" its planted bugs;
"issue 30 review" the maintainer's review that issue 30 quotes.
"""
from __future__ import annotations

from dataclasses import dataclass

FAST = ("-m", "not slow")


@dataclass(frozen=True)
class Plant:
    name: str
    file: str                   # repo-relative
    old: str                    # occurs exactly once in `file`
    new: str
    why: str                    # what goes wrong for a user
    source: str                 # where the plant comes from
    selection: tuple[str, ...]  # pytest arguments: these tests must fail with the plant in
    also: tuple[tuple[str, str, str], ...] = ()  # the same bug's further (file, old, new) edits

    @property
    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.file, self.old, self.new), *self.also]


ENG, OPT, COMM, CKPT, FUSED = ("zerofunc/engine.py", "zerofunc/sharded_optim.py", "zerofunc/comm.py",
                               "zerofunc/checkpoint.py", "zerofunc/fused.py")
RED = "zerofunc/reduction.py"
HOOKS = "zerofunc/block_hooks.py"  # the engine's block hooks (a mixin of ZeroEngine's)
PLAN, HYBRID_REPLICAS = "zerofunc/plan/simulation.py", (
    "        if self.replicas is not None:\n"
    "            shard_bytes = unit.grad.numel() * unit.grad.element_size()\n"
    '            self._reducing.add(average_over_replicas(self.replicas, unit.grad, async_op=\n')
# where a unit's reduce-scatter ends: at the boundary, the replicas' average and offload follow
REDUCED_AT_BOUNDARY = "            if boundary:\n                self._reduced_for_the_step(unit)\n"
EQ1 = "tests/test_equivalence.py::test_every_stage_trains_like_one_device[1]"
EQ2 = "tests/test_equivalence.py::test_every_stage_trains_like_one_device[2]"
HYBRID2 = "tests/test_hybrid.py::test_hybrid_sharding_trains_like_one_device[2]"
SKIP_RESUME = "tests/test_faults.py::test_skipping_nonfinite_steps_keeps_nan_out_of_the_weights_and_resumes_exactly"
KM, PLAN_CMD, INIT = "sim/kernel_memory.py", "zerofunc/plan/command.py", "tests/test_init_from.py"
FINETUNE = "tests/test_finetune.py::test_prepare_train_export_load"
