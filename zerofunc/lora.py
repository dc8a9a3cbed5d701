"""LoRA (Hu et al., 2021) with PEFT's semantics, on any model, without PEFT: each target layer (an
`nn.Linear`, or GPT-2's `Conv1D` whose weight is stored [in, out]) keeps its weight, frozen, and gains
`lora_A`, a Linear [r, in] drawn kaiming-uniform (a = sqrt(5)), and `lora_B`, a Linear [out, r] of zeros,
so that its output is

    base(x) + lora_B(lora_A(dropout(x))) * alpha / r

Every other parameter of the model is frozen too (PEFT's `get_peft_model`): the engine then keeps the base
in the training dtype only, with no gradient, optimizer state or reduction (zerofunc/units.py, FrozenPart),
and trains the adapters. The adapters are submodules named as PEFT names them (`<layer>.lora_A.weight`), so
an adapter's tensors map to PEFT's keys by a prefix; the base keeps its own parameter names, and so its
pretrained files, checkpoints and exports read as before. The added path runs in a forward hook of the
layer, inside the block's forward: the tape, compiled blocks and stage 3's gathering see one more pair of
weights in the block, nothing else.
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofunc.units import InitFn

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoRA:
    """`r` the rank, `alpha` the scale's numerator (PEFT's default 8), `targets`: "all-linear" (every Linear
    and Conv1D but the output head), layer names (the last part of a module's name: "q_proj,v_proj"), or a
    regular expression a module's whole name matches; `dropout` on the adapter's input."""

    r: int
    alpha: float = 8.0
    targets: str = ALL_LINEAR
    dropout: float = 0.0

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def _in_out(layer: nn.Module) -> Optional[tuple[int, int]]:
    """A target layer's (in, out) features: a Linear's weight is [out, in], a Conv1D's [in, out]."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if type(layer).__name__ == "Conv1D" and getattr(layer, "weight", None) is not None:
        return layer.weight.shape[0], layer.weight.shape[1]
    return None


def targets(model: nn.Module, lora: LoRA) -> list[str]:
    """The names of the layers `lora.targets` selects in `model`."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [(n, m) for n, m in model.named_modules()  # the output head is no target, as in PEFT's all-linear
              if _in_out(m) is not None and m is not head and n.rsplit(".", 1)[-1] != "lm_head"]
    if lora.targets == ALL_LINEAR:
        return [n for n, _ in layers]
    if re.fullmatch(r"[\w.]+(,[\w.]+)*", lora.targets):
        wanted = set(lora.targets.split(","))
        return [n for n, _ in layers if n.rsplit(".", 1)[-1] in wanted or n in wanted]
    try:
        pattern = re.compile(lora.targets)
    except re.error as e:
        raise ValueError(f"--lora-targets {lora.targets!r} is not a regular expression: {e}") from None
    return [n for n, _ in layers if pattern.fullmatch(n)]


def apply_lora(model: nn.Module, lora: LoRA) -> list[str]:
    """Freeze every parameter of `model` and give each target layer its adapter (see the module's docstring),
    on the device its weight is on (the meta device too); the targets' names. ValueError where none matches."""
    names = targets(model, lora)
    if not names:
        raise ValueError(f"--lora-targets {lora.targets!r} selects no Linear or Conv1D layer of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        layer = model.get_submodule(name)
        fan_in, fan_out = _in_out(layer)
        device = layer.weight.device
        layer.lora_A = nn.Linear(fan_in, lora.r, bias=False, device=device)
        layer.lora_B = nn.Linear(lora.r, fan_out, bias=False, device=device)
        nn.init.zeros_(layer.lora_B.weight)  # lora_A keeps nn.Linear's own draw: kaiming-uniform, a = sqrt(5)
        layer.register_forward_hook(_Adapter(lora.scaling, lora.dropout))
    return names


class _Adapter:
    """The layer's forward hook: its output plus the adapter's path (a class, not a closure, so that a
    model with adapters pickles and deep-copies)."""

    def __init__(self, scaling: float, dropout: float):
        self.scaling, self.dropout = scaling, dropout

    def __call__(self, layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # as PEFT's Linear.forward: the input cast to the adapters' dtype (fp32 under a 16-bit base), then
        # dropped out; the sum in the wider dtype, rounded once to the layer's
        x = args[0].to(layer.lora_A.weight.dtype)
        if self.dropout:
            x = F.dropout(x, self.dropout, layer.training)
        return (out + layer.lora_B(layer.lora_A(x)) * self.scaling).to(out.dtype)


_ADAPTER = re.compile(r"(^|.*\.)lora_[AB]\.(\w+\.)?weight")  # ours, and PEFT's (...lora_A.<adapter>.weight)


def is_adapter(name: str) -> bool:
    return _ADAPTER.fullmatch(name) is not None


def weights_dtype(names: list[str], compute: torch.dtype) -> torch.dtype:
    """The dtype a unit keeps its trainable weights (`names`) in: the compute dtype, but fp32 where all of them
    are LoRA adapters (PEFT's autocast_adapter_dtype: adapters train in fp32 under a 16-bit base, their
    input cast up and their output down by the layer's hook, `_Adapter`)."""
    return torch.float32 if names and all(map(is_adapter, names)) else compute


def adapter_value(name: str, shape: tuple[int, ...], seed: int) -> Optional[torch.Tensor]:
    """An adapter weight's initial value from (seed, name) alone, as PEFT draws it: lora_A kaiming-uniform
    with a = sqrt(5) (bound 1 / sqrt(in)), lora_B zeros; None for any other parameter."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(shape)
    if not name.endswith(".lora_A.weight"):
        return None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


class WithAdapters:
    """An init (zerofunc/units.py's InitFn) for a model given adapters: the adapters' values drawn here, every
    other parameter's from `base` (pretrained files read by shard through its `read_into`, when it has one)."""

    def __init__(self, base: InitFn, seed: int):
        self.base, self.seed = base, seed
        if hasattr(base, "read_into"):
            self.read_into = self._read_into
        if hasattr(base, "locate"):  # where the base's weights are stored (zerofunc/frozen_source.py)
            self.locate = self._locate

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        value = adapter_value(name, shape, self.seed)
        return value if value is not None else self.base(name, shape)

    def _locate(self, name: str):
        return None if is_adapter(name) else self.base.locate(name)

    def _read_into(self, name, shape, lo, hi, out, memory) -> None:
        value = adapter_value(name, shape, self.seed)
        if value is None:
            self.base.read_into(name, shape, lo, hi, out, memory)
        else:
            out.copy_(value.reshape(-1)[lo:hi])


def add_lora_flags(p, what: str, dropout: bool = True) -> None:
    """--lora R, --lora-alpha, --lora-targets (and --lora-dropout) on a command line: the trainer's, the
    planner's and the check's, which `lora_from_flags` turns into a LoRA."""
    p.add_argument("--lora", type=int, default=None, metavar="R", help=f"{what} LoRA of rank R: the model frozen, "
                   "adapters trained on its Linear layers (PEFT's semantics)")
    p.add_argument("--lora-alpha", type=float, default=8.0, metavar="A", help="LoRA's scale is A / R (default 8)")
    p.add_argument("--lora-targets", default=ALL_LINEAR, metavar="T",
                   help="all-linear (every Linear but the head; default), layer names (q_proj,v_proj) or a regex of "
                        "whole module names")
    if dropout:
        p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="dropout on the adapters' input")


def lora_from_flags(a) -> Optional[LoRA]:
    """The LoRA `add_lora_flags`' flags give, None without --lora; ValueError for a bad one."""
    if a.lora is None:
        return None
    return LoRA(a.lora, a.lora_alpha, a.lora_targets, getattr(a, "lora_dropout", 0.0))
