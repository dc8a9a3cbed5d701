"""The plant register: frozen parameters (zerofunc/units.py's FrozenPart, issue 32)."""
from __future__ import annotations

from tests.plant_register.common import Plant

UNITS = "zerofunc/units.py"
TRAIN = "tests/test_frozen.py::test_frozen_parameters_stay_and_the_rest_train_like_one_device"

PLANTS: list[Plant] = [
    Plant("frozen_parameters_trained", UNITS,
          "    frozen = [(n, p) for n, p in named if not p.requires_grad]\n"
          "    layout = FlatLayout.build([(n, p.shape) for n, p in named if p.requires_grad], world_size)\n",
          "    frozen = []\n"
          "    layout = FlatLayout.build([(n, p.shape) for n, p in named], world_size)\n",
          "requires_grad=False is ignored, as before issue 32: a frozen base is trained, decayed and given AdamW "
          "state, so every partial fine-tune is silently wrong",
          "issue 32", (TRAIN, "tests/test_lora.py::test_a_peft_model_trains_through_initialize_like_peft_on_one_device")),
    Plant("frozen_weights_masked_not_split", UNITS,
          "        return self.layout.views(self.full)\n",
          "        return self.layout.views(self.full.detach().requires_grad_())\n",
          "frozen weights enter the forward as views of a leaf that needs a gradient, so autograd computes every "
          "frozen weight's gradient and throws it away: the same numbers, none of LoRA's compute saved",
          "issue 32", ("tests/test_frozen.py::test_autograd_computes_no_gradient_of_a_frozen_weight",)),
    Plant("frozen_part_not_gathered", "zerofunc/gather.py",
          "        yield unit\n        if unit.frozen is not None:\n            yield unit.frozen\n",
          "        yield unit\n",
          "stage 3 gathers a unit's trainable shard but not its frozen one: the forward reads a released buffer",
          "issue 32", (TRAIN,)),
    Plant("frozen_part_without_node_copy", "zerofunc/gather.py",
          "                    for part in self._parts(unit):\n                        part.secondary = shard(",
          "                    for part in [unit]:\n                        part.secondary = shard(",
          "under hpZ a unit's frozen weights keep no node copy: backward gathers them across the whole shard "
          "group (across nodes), not inside the node, as it did before",
          "issue 32", ("tests/test_frozen.py::test_frozen_parameters_with_every_lever",)),
]
