"""The plant register: the tape (issue 31)."""
from __future__ import annotations

from tests.plant_register.common import Plant

PLANTS: list[Plant] = [
    # -- issue 31: the tape (zerofunc/tape.py) -------------------------------------------------------------
    Plant("tape_keeps_one_gradient_of_a_tensor_taken_twice", "zerofunc/tape.py",
          "g if held is None else held[2] + g)", "g)",
          "a tensor two later segments take (a residual stream, a mask, a learned bias) gets the last one's gradient",
          "issue 31", ("tests/test_tape.py",)),
    Plant("tape_places_unseen_calls_where_they_are_taken", "zerofunc/tape.py",
          "        segments = self._segments_behind(node, {})\n", "        segments = set()\n",
          "a custom autograd Function's output is taken as the current segment's: its graph joins an earlier one's",
          "issue 31", ("tests/test_tape.py",)),
    Plant("compiled_block_regathered_before_the_head", "zerofunc/block_hooks.py",
          "            if self._tape is not None:\n                self._tape.open(None)  #",
          "            if False:\n                self._tape.open(None)  #",
          "the head's backward shares the last block's segment: a compiled stage-3 block is regathered before the "
          "head's root, so the collectives run in another order than planned (seen on the H100)",
          "issue 31, CUDA run 2", ("tests/test_check.py::test_compiled_stage_3_is_planned_to_the_byte_and_within_2_percent",)),
    Plant("fork_server_asks_cuda", "zerofunc/fused.py",
          'if os.environ.get("TRITON_INTERPRET") == "1":\n    _load()',
          'if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":\n    _load()',
          "importing the engine asks CUDA whether it is there: every rank forked from the launcher's fork server "
          "fails with 'Cannot re-initialize CUDA in forked subprocess' (seen on the H100)",
          "issue 31, CUDA run 2",
          ("tests/test_launch.py::test_the_ranks_fork_server_imports_without_asking_cuda_anything",)),
    Plant("tape_lets_a_plain_backward_through", "zerofunc/engine.py",
          "Tape(_outside_the_engine, self._read_unbound)", "Tape(None, self._read_unbound)",
          "loss.backward() reaches only the last segment's leaves (a head without weights): it trains nothing, silently",
          "issue 31", ("tests/test_engine_misuse.py::test_misuse_fails_loudly_and_a_failed_forward_leaves_no_trace",)),
    Plant("tape_lets_a_block_read_past_its_arguments", "zerofunc/tape.py",
          "                    if check_reads and self._segments_behind(t.grad_fn, seen) - {here}:\n",
          "                    if False:\n",
          "a block (run unwatched) reads an earlier segment's tensor through a module attribute: two segments' "
          "graphs join, and the second backward through them fails or drops a gradient",
          "issue 31", ("tests/test_tape.py",)),
    Plant("tape_leaves_belong_to_no_segment", "zerofunc/tape.py",
          "        if tag is None and not node.next_functions:  # a leaf's AccumulateGrad",
          "        if False:  # a leaf's AccumulateGrad",
          "a tensor a block keeps (made from its input leaf, unwatched) is taken as a weight's: its gradient to the "
          "block's input is silently dropped",
          "issue 31", ("tests/test_tape.py",)),
    Plant("engine_leaves_its_forwards_in_the_callers_modules", "zerofunc/binding.py",
          "        for obj, name, old in reversed(saved):\n", "        for obj, name, old in []:\n",
          "the engine's forwards (a checkpointed, compiled or unwatched block) stay in the caller's modules after "
          "its call: the caller's module is rewritten, and calling it outside the engine runs the engine's code",
          "issue 31", ("tests/test_engine_misuse.py", "-m", "not slow")),
    Plant("bound_modules_kept_across_models", "zerofunc/binding.py",
          "    found = _FOUND.get(model)\n",
          "    found = next(iter(_FOUND.values()), None)\n",
          "the modules a parameter name binds into are found once per process, not per model: a second model of the "
          "same names (the planner's on meta, then the trainer's) has its blocks' weights bound into the first's",
          "issue 31", ("tests/test_llama_plan.py::test_planned_step_is_the_trained_step[llama-tiny]",)),
    Plant("tied_weight_bound_under_one_name", "zerofunc/binding.py",
          "_Found(slots, {a[0]: a for a in names.values() if len(a) > 1})",
          "_Found(slots, {})",
          "a weight two modules share (a head tied to its embedding) is bound under its first name only: the other "
          "module computes with its released placeholder, on meta", "issue 31",
          ("tests/test_api.py::test_initialize_trains_any_module_like_one_device[0-sequential-blocks2]",)),
    Plant("step_writes_the_engines_state", "zerofunc/step.py",
          "        after = engine.update(state)\n",
          "        after = engine.state = engine.update(state)\n",
          "the functional step also writes the state it returns into the engine: a caller holding two states (a "
          "rollback, an experiment) finds the engine's moved under it, and the step is no function",
          "issue 31", ("tests/test_step_function.py",)),
]
