"""The plant register: LoRA (zerofunc/lora.py, issue 32)."""
from __future__ import annotations

from tests.plant_register.common import Plant

LORA = "zerofunc/lora.py"

PLANTS: list[Plant] = [
    Plant("lora_b_drawn_not_zero", LORA,
          "        nn.init.zeros_(layer.lora_B.weight)  #", "        nn.init.normal_(layer.lora_B.weight)  #",
          "lora_B starts drawn, not zero: the adapted model no longer starts as its pretrained base",
          "issue 32", ("tests/test_lora.py::test_an_adapted_model_starts_as_its_base_with_peft_s_adapters",)),
    Plant("lora_scaling_inverted", LORA,
          "        return self.alpha / self.r\n", "        return self.r / self.alpha\n",
          "LoRA's scale is r / alpha, not alpha / r: the adapters' updates are scaled wrongly for every r != alpha",
          "issue 32", ("tests/test_lora.py::test_an_adapted_layer_adds_its_scaled_low_rank_path",)),
    Plant("lora_adapters_frozen_too", LORA,
          "    for p in model.parameters():\n        p.requires_grad_(False)\n    for name in names:\n",
          "    for name in names:\n",
          "the model is frozen after the adapters are added, not before: nothing trains",
          "issue 32", ("tests/test_lora.py::test_lora_trains_like_one_device_at_every_stage",),
          also=((LORA, "        layer.register_forward_hook(_Adapter(lora.scaling, lora.dropout))\n    return names\n",
                 "        layer.register_forward_hook(_Adapter(lora.scaling, lora.dropout))\n"
                 "    for p in model.parameters():\n        p.requires_grad_(False)\n    return names\n"),)),
    Plant("lora_adapters_in_bf16", LORA,
          "    return torch.float32 if names and all(map(is_adapter, names)) else compute\n",
          "    return compute\n",
          "under bf16 the adapters are kept, and trained, in bf16 as the base is: not PEFT's fp32 adapters",
          "issue 32", ("tests/test_lora.py::test_lora_trains_like_one_device_at_every_stage",)),
    Plant("fp32_adapters_reduced_in_bf16", "zerofunc/reduction.py",
          "        dtype = reduced_dtype(grad.dtype, self.reduce_dtype)  #",
          "        dtype = self.reduce_dtype  #",
          "fp32 adapters' gradients are rounded to bf16 for their reduction: the reduced gradient loses 16 bits",
          "issue 32", ("tests/test_lora.py::test_lora_trains_like_one_device_at_every_stage",)),
    Plant("plan_ignores_lora", "zerofunc/plan/__init__.py",
          "        if self.lora is not None:\n            apply_lora(model, self.lora)\n", "",
          "the planner plans a LoRA run as a full fine-tune: optimizer state and reduce-scatters for the frozen "
          "weights, which the trainer never has",
          "issue 32", ("tests/test_plan.py::test_a_lora_plan_is_the_lora_step",)),
]
