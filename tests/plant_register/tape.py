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
]
