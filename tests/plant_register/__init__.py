"""The plant register's entries: real bugs, each with the tests that must fail while it is in.
`python -m tests.plants` (tests/plants.py) plants them one at a time in a copy of the tree and runs those tests.
The entries are grouped by what they break, a file each; common.py has the entry's shape."""
from __future__ import annotations

from tests.plant_register import (engine, frozen, frozen_checkpoint, kernels, lora, runs, planner, issue30, tape,
                                   whole_step)
from tests.plant_register.common import Plant

PLANTS: list[Plant] = [*engine.PLANTS, *kernels.PLANTS, *runs.PLANTS, *planner.PLANTS, *issue30.PLANTS, *tape.PLANTS,
                       *whole_step.PLANTS, *frozen.PLANTS, *frozen_checkpoint.PLANTS, *lora.PLANTS]

__all__ = ["PLANTS", "Plant"]
