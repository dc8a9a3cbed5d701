"""The plant register: checkpoints of frozen weights (zerofunc/checkpoint.py, zerofunc/frozen_source.py, issue 32)."""
from __future__ import annotations

from tests.plant_register.common import Plant

CKPT = "zerofunc/checkpoint.py"
SAVED = "tests/test_frozen_checkpoint.py::test_frozen_weights_resume_bit_for_bit_at_another_world_size_and_stage"
SOURCE = "tests/test_frozen_checkpoint.py::test_a_lora_checkpoint_records_its_base_files_and_resumes_from_them"

PLANTS: list[Plant] = [
    Plant("frozen_checkpoint_not_loaded", CKPT,
          "                    unit.frozen.params[a - start:b - start].copy_(",
          "                    unit.frozen.params[a - start:b - start].add_(0 * ",
          "a load restores the trained weights and moments but leaves the frozen ones as the engine made them: "
          "a resumed partial fine-tune runs on another base",
          "issue 32", (SAVED,)),
    Plant("frozen_checkpoint_trainable_span", CKPT,
          "    start, stop = _owned_span(engine, unit.frozen.layout)\n",
          "    start, stop = _owned_span(engine, unit.layout)\n",
          "each rank saves the span of the trainable buffer's shard boundaries out of its frozen buffer: at another "
          "world size the frozen weights come back shifted",
          "issue 32", (SAVED,)),
    Plant("frozen_source_not_read_on_load", CKPT,
          "                            reader.read_into(slot.name, slot.shape, lo, hi, unit.frozen.params[at:at + hi - lo],",
          "                            (lambda *a: None)(slot.name, slot.shape, lo, hi, unit.frozen.params[at:at + hi - lo],",
          "a checkpoint that records its frozen weights' files resumes without reading them: the run goes on with "
          "whatever the engine was initialized with (random weights, on resume)",
          "issue 32", (SOURCE,)),
    Plant("frozen_source_hash_not_checked", "zerofunc/frozen_source.py",
          "    if _sha256(path) != record[\"sha256\"][f]:\n",
          "    if False:\n",
          "a changed base file is read as if it were the one the adapters were trained on",
          "issue 32", (SOURCE,)),
    Plant("merged_export_without_scaling", "zerofunc/hf_export.py",
          "            t = replace(t, merge=(a, b, lora[\"alpha\"] / lora[\"r\"]))\n",
          "            t = replace(t, merge=(a, b, 1.0))\n",
          "consolidate --hf merges W + B A, without LoRA's alpha / r: the exported model is not the one trained",
          "issue 32", (SOURCE,)),
    Plant("merged_export_leaves_adapters_out", "zerofunc/hf_export.py",
          "            value += scaling * (",
          "            value += 0 * scaling * (",
          "consolidate --hf of a LoRA run writes the base weights alone: the fine-tune is lost",
          "issue 32", (SOURCE,)),
    Plant("adapter_keys_without_peft_prefix", "zerofunc/peft_export.py",
          'tensors[f"base_model.model.{hf_module}.{which}.weight"]',
          'tensors[f"{hf_module}.{which}.weight"]',
          "the PEFT adapter's tensors are named as the model's modules, not PEFT's base_model.model.*: "
          "PeftModel.from_pretrained loads none of them and keeps its fresh adapters",
          "issue 32", (SOURCE,)),
    Plant("adapter_alpha_is_r", "zerofunc/peft_export.py",
          '"lora_alpha": lora["alpha"]', '"lora_alpha": lora["r"]',
          "the adapter config says alpha = r: PEFT scales the adapters by 1, not alpha / r",
          "issue 32", (SOURCE,)),
    Plant("frozen_unit_not_released", "zerofunc/engine.py",
          "        if grad is not None:\n            self.reduction.add(unit, grad, boundary)\n"
          "        elif boundary and unit.numel:\n            self.reduction.left_out(unit)\n        self.gathering.leave(unit)",
          "        if grad is not None:\n            self.reduction.add(unit, grad, boundary)\n            self.gathering.leave(unit)\n"
          "        elif boundary and unit.numel:\n            self.reduction.left_out(unit)",
          "a stage-3 unit whose weights are all frozen is never released after backward: it stays gathered between "
          "steps, and the next step skips its gather (not the plan's collectives, nor its memory)",
          "issue 32", ("tests/test_check.py::test_lora_is_planned_to_the_byte_and_within_2_percent_step_after_step",)),
]
