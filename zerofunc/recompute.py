"""Activation checkpointing: a block keeps only its inputs, and recomputes its forward in backward.

`ActivationCheckpointing` says which blocks (the stage-3 gather units, for any model):
- "none": every block keeps its activations (the default);
- "full": every block recomputes;
- "selective": every `every`-th block recomputes (the first, then every `every`-th after it),
  torchtitan's layer-selective mode;
- "selective-op": every block recomputes, but keeps the outputs of its compute-heavy ops, as
  torchtitan's op-selective mode does: the attention's, and every second matmul's (`mm` and
  `addmm`, counted in the block's order, the same in its forward and in its recomputation); the
  rest (norms, activations, the other matmuls) is recomputed. Ops are recognized by the aten op
  they dispatch to, so this holds for any model whose blocks run aten's matmuls and
  scaled-dot-product attention (torch's `create_selective_checkpoint_contexts`). Under a dispatch
  mode, as this selection is, a block compiled with torch.compile runs eager.

The mechanism is torch's non-reentrant `torch.utils.checkpoint`: the forward saves nothing
inside the block, and the first time backward needs one of its tensors the block runs
again, tensor for tensor, under the same RNG state (so dropout draws the same masks; our
models seed dropout by sample and need no RNG state at all). Autograd still walks the
original graph, so each unit's gradient reaches the engine exactly as without
checkpointing, and training is bit for bit the same in fp32.

The output head is not a block, but it keeps the largest activations of all: the logits and
their softmax, vocabulary-wide per token. A model whose loss is `zerofunc.lm_head.LinearCrossEntropy`
(zerofunc's GPT-2 and Llama are) recomputes its logits chunk by chunk whenever checkpointing is
on, in any mode; other models keep their head as they compute it.

A recomputed block's weights must be bound again (the engine binds a block's views only
while its forward runs), and under stage 3 gathered again: the engine's `recompute`
callback does both, marks the time in the memory timeline, and leaves the unit gathered
for the backward that follows, which releases it.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective", "selective-op")

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
ATTENTION = frozenset(getattr(_aten, name).default for name in (  # each backend's kernel (CPU's its own)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def keep_attention_and_every_second_matmul():
    """The op-selective policy's contexts for one run of one block: a fresh matmul count for its forward
    and for its recomputation, so each keeps the same matmuls' outputs."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


@dataclass(frozen=True)
class ActivationCheckpointing:
    mode: str = "none"
    every: int = 2  # selective: one block in `every` recomputes

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"activation checkpointing every K blocks needs K >= 1, got {self.every}")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    def recomputes(self, block: int) -> bool:
        """Whether block number `block` (from 0, in forward order) is checkpointed."""
        return self.mode in ("full", "selective-op") or (self.mode == "selective" and block % self.every == 0)

    @property
    def keeps_ops(self) -> bool:
        """Whether a checkpointed block keeps some ops' outputs (selective-op) rather than none."""
        return self.mode == "selective-op"

    def describe(self) -> str:
        return {"none": "none", "full": "full", "selective-op": "ops"}.get(self.mode, f"every {self.every}")


def step_settings(model: torch.nn.Module, on: bool) -> list:
    """What `binding.installed` sets in `model` while a step runs, forward and backward: with checkpointing `on`,
    every `LinearCrossEntropy` head recomputes its logits in backward, chunk by chunk, eager or in a compiled
    step (zerofunc/lm_head.py); and the model's own checkpointing off (Hugging Face's `gradient_checkpointing`,
    which `gradient_checkpointing_enable()` sets): it checkpoints a layer's forward inside the module's hooks,
    so its recomputation in backward would run without them, on the released weights, and inside the engine's
    own recomputation it would checkpoint the block again. `model_checkpoints` turns it into the engine's."""
    from zerofunc.lm_head import LinearCrossEntropy
    return ([(m, "recompute", on) for m in model.modules() if isinstance(m, LinearCrossEntropy)]
            + [(m, "gradient_checkpointing", False) for m in model.modules() if hasattr(m, "gradient_checkpointing")])


def model_checkpoints(model: torch.nn.Module) -> bool:
    """Whether the model's own code recomputes its layers in backward: Hugging Face's gradient checkpointing on
    (`gradient_checkpointing_enable()`), as a Trainer's `gradient_checkpointing=True` sets it. `initialize`
    then recomputes each block itself (full activation checkpointing), as DeepSpeed's ZeRO-3 runs it."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def checkpointed(forward: Callable, in_forward: Callable[[], bool], recompute: Callable[[], contextlib.AbstractContextManager],
                 keep_ops: bool = False):
    """`forward` run under non-reentrant checkpointing; `keep_ops`: keeping the attention's and every second
    matmul's outputs (selective-op).

    `in_forward()` tells the first run (the engine has bound the block's weights) from the
    recomputation in backward, which runs inside `recompute()`: the engine's context that
    gathers and binds the weights again. The RNG state is restored for the recomputation
    except on the meta device, which has none.
    """
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        args, kwargs = without_cache(args, kwargs)
        meta = any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in (*args, *kwargs.values()))
        modes = _get_current_function_mode_stack()

        def run_block(*args, **kwargs):
            if in_forward():
                return forward(*args, **kwargs)
            with _outside_the_selection(recompute()) if keep_ops else recompute(), contextlib.ExitStack() as stack:
                # the forward's function modes, as checkpoint restores its autocast state: a mode
                # is off while its own handler runs, and backward may have been called from one
                active = _get_current_function_mode_stack()
                for mode in modes:
                    if all(mode is not m for m in active):
                        stack.enter_context(mode)
                return forward(*args, **kwargs)

        selective = {"context_fn": keep_attention_and_every_second_matmul} if keep_ops else {}
        return checkpoint(run_block, *args, use_reentrant=False, preserve_rng_state=not meta, **selective, **kwargs)
    return wrapper


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A checkpointed block's arguments with no key/value cache (a Hugging Face layer's, by keyword or, as
    GPT-2 passes it, by position): a cache is state the block's forward changes, appending its keys and
    values, so the block run again in backward would find them there and attend to them twice (or, under
    selective-op, run ops its forward did not, which torch refuses), and every layer's keys and values
    would stay referenced until the forward ends. Hugging Face's own checkpointing passes its layers no
    cache, for these reasons. Only a Hugging Face cache object is taken out: a block's other arguments,
    whatever their names, are its own."""
    if not any(map(_is_hf_cache, (*args, *kwargs.values()))):
        return args, kwargs
    args = tuple(None if _is_hf_cache(a) else a for a in args)
    kwargs = {k: None if _is_hf_cache(v) else v for k, v in kwargs.items()}
    return args, {**kwargs, "use_cache": False} if "use_cache" in kwargs else kwargs


def _is_hf_cache(value) -> bool:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float)):  # a block's usual arguments, told
        return False  # apart without string methods on a type's name, which torch 2.11's dynamo cannot trace
    kind = type(value)
    return kind.__module__.startswith("transformers.") and kind.__name__.endswith("Cache")


@contextlib.contextmanager
def _outside_the_selection(context: contextlib.AbstractContextManager):
    """`context` (the engine's regather and binding) entered and left outside selective checkpointing's
    dispatch mode, the innermost while a block is recomputed: that mode replays the ops of the block's
    first run one for one, and the regather's ops were not among them (the first run gathered before it)."""
    with _pop_mode_temporarily():
        context.__enter__()
    try:
        yield
    except BaseException as e:
        with _pop_mode_temporarily():
            if not context.__exit__(type(e), e, e.__traceback__):
                raise
    else:
        with _pop_mode_temporarily():
            context.__exit__(None, None, None)
