"""A LoRA run's adapters as a PEFT adapter directory, which `PeftModel.from_pretrained(base, OUT_DIR)` loads.

    OUT_DIR/adapter_config.json           peft_type "LORA", r, lora_alpha, target_modules, lora_dropout, ...
    OUT_DIR/adapter_model.safetensors     base_model.model.<Hugging Face module>.lora_A.weight / .lora_B.weight

The adapters are PEFT's own (zerofunc/lora.py): A [r, in], B [out, r], scaled by alpha / r, so their
values go out as trained, in fp32, under the names PEFT saves them by: `base_model.model.` and the adapted
module's path in the Hugging Face model (zerofunc/hf_names.py's map, the one `--hf` writes with). GPT-2's
Conv1D layers are adapted with `fan_in_fan_out`, as PEFT adapts them; its A and B are shaped as any
Linear's. Only a run that recorded its LoRA (`python -m train --lora`) has one to export; the adapters are
read from the checkpoint's fp32 masters, whichever world size and stage saved them, each file checked
against its SHA-256 first. Nothing appears under OUT_DIR until both files are written
(zerofunc/export_dir.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from zerofunc.checkpoint_files import read_manifest, resolve
from zerofunc.export_dir import ExportError, check_target, staged
from zerofunc.hf_export import build_meta_model
from zerofunc.hf_names import hf_names
from zerofunc.lora import is_adapter
from zerofunc.pretrained import CheckpointWeights

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def export_adapter(checkpoint: str, out_dir: str, model_spec: Optional[str] = None) -> dict:
    """Write the LoRA adapters of `checkpoint` (a checkpoint or run directory) as a PEFT adapter directory."""
    ckpt = resolve(checkpoint)
    manifest = read_manifest(ckpt)
    extra = manifest.get("extra", {})
    lora = extra.get("lora")
    if not lora:
        raise ExportError(f"checkpoint {ckpt} holds no LoRA adapters (it was not trained with --lora)")
    spec = model_spec or extra.get("model")
    if not spec:
        raise ExportError(f"checkpoint {ckpt} does not record its model: pass --model")
    names = hf_names(build_meta_model(spec))
    source = CheckpointWeights(ckpt)
    adapters = sorted(n for n in source.shapes if is_adapter(n))
    modules = sorted({names.key(n.rsplit(".", 2)[0] + ".weight").removesuffix(".weight") for n in adapters})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["r"], "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"], "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "fan_in_fan_out": names.conv1d, "bias": "none", "inference_mode": True, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None,
        "base_model_name_or_path": extra.get("init_from") or _model_dir(spec),
    }
    out = Path(out_dir)
    check_target(out)
    with staged(out) as tmp:
        tensors = {}
        for name in adapters:  # ours: <module>.lora_A.weight; PEFT's: base_model.model.<HF module>.lora_A.weight
            module, which = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            hf_module = names.key(module + ".weight").removesuffix(".weight")
            tensors[f"base_model.model.{hf_module}.{which}.weight"] = source(name, source.shapes[name]).contiguous()
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"modules": len(modules), "parameters": sum(t.numel() for t in tensors.values())}


def _model_dir(spec: str) -> str:
    """The directory a model spec's config.json sits in (what PEFT's base_model_name_or_path names), or the spec."""
    path = Path(spec)
    return str(path.parent if path.name == "config.json" else path)
