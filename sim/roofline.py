"""Compute time from the ops a step runs: a roofline per op.

`Roofline` is a dispatch mode. For each op it takes the FLOPs from torch's own
formulas (torch.utils.flop_counter) and the bytes it reads and writes (its tensor
inputs and outputs; views move nothing), and charges
max(FLOPs / peak rate for the op's dtype, bytes / memory bandwidth), plus a fixed
overhead per op (dispatch and autograd's bookkeeping, which dominate small ops on a CPU).
The sum is the step's compute time on a device with those rates, if nothing overlaps.
A GPU profile prices each op by its class instead (GEMM, attention, memory-bound, launch floor:
sim.kernel_cost), from published constants.

Work placed elsewhere (sim.placement: ZeRO-Offload's optimizer on the host, copies
over the host link) is not device compute: it is timed apart, at the host's streaming
rate or the link's bandwidth, by the bytes it reads and writes.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from sim import placement
from sim.kernel_cost import BOUNDS, KernelCosts
from sim.tensors import tensors as tensors_in

_aten = torch.ops.aten
# The CPU flash kernel has no formula of its own; its leading arguments match CUDA flash's.
_FORWARD_ALIAS = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention}
_BACKWARD_CPU = _aten._scaled_dot_product_flash_attention_for_cpu_backward
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_backward
_QUERY_AT = {_aten._scaled_dot_product_flash_attention: 0, _FLASH_BACKWARD: 1}  # k and v follow q


def _multi_head(args: tuple, at: int) -> tuple:
    """The arguments with k and v shaped as if every query head had its own (grouped-query
    attention costs the FLOPs of full attention; torch 2.11's formulas assert equal head
    counts). Formulas take shapes as well as tensors, so nothing is allocated."""
    q, k, v = args[at:at + 3]
    if k.shape[1] == q.shape[1]:
        return args
    heads = lambda t: torch.Size((t.shape[0], q.shape[1], *t.shape[2:]))  # noqa: E731
    return (*args[:at + 1], heads(k), heads(v), *args[at + 3:])


def op_flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    if packet is _BACKWARD_CPU:
        grad_out, q, k, v, o, lse = args[:6]
        args, packet = (grad_out, q, k, v, o, lse, None, None, None, None), _FLASH_BACKWARD
    packet = _FORWARD_ALIAS.get(packet, packet)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    if packet in _QUERY_AT:
        args = _multi_head(args, _QUERY_AT[packet])
    return int(formula(*args, **(kwargs or {}), out_val=out))


# The bytes this roofline counts for one parameter of a fused AdamW (torch._fused_adamw_): param,
# grad, m and v read (fp32), and each written, as the op's schema marks them all mutable. A host's
# AdamW rate in parameters/s times this is the host rate in these bytes.
ADAMW_BYTES_COUNTED = 32


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _written_in_place(func, args) -> int:
    """Bytes of the arguments an op writes without returning them (a fused optimizer's state):
    each is read and written, and only the read is among the inputs."""
    if func._schema.returns:
        return 0
    return sum(_nbytes(t) for arg, value in zip(func._schema.arguments, args)
               if arg.alias_info is not None and arg.alias_info.is_write for t in tensors_in(value))


class Roofline(TorchDispatchMode):
    """`flops_per_s`: the peak rate per dtype, reached at `compute_efficiency` of it; with `kernels`,
    each op is priced by its class (sim.kernel_cost) and `compute_efficiency` applies only to ops that
    are neither GEMMs nor attention."""

    def __init__(self, flops_per_s: dict[str, float], bytes_per_s: float, host_bytes_per_s: float = float("inf"),
                 link_bytes_per_s: float = float("inf"), op_overhead_s: float = 0.0, compute_efficiency: float = 1.0,
                 kernels: KernelCosts | None = None):
        super().__init__()
        self.flops_per_s, self.bytes_per_s, self.op_overhead_s = flops_per_s, bytes_per_s, op_overhead_s
        self.compute_efficiency, self.kernels = compute_efficiency, kernels
        self._elsewhere = {"host": host_bytes_per_s, "d2h": link_bytes_per_s, "h2d": link_bytes_per_s}
        self.flops = 0
        self.bytes = 0
        self.time_s = 0.0  # on the device
        # of time_s, by what bounds each op (sim.kernel_cost; else "roofline"), every bound named even at 0
        self.time_by_bound = dict.fromkeys(BOUNDS, 0.0)
        self.elsewhere_s = dict.fromkeys(self._elsewhere, 0.0)  # on the host, and each way over the link

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        results = list(tensors_in(out))
        moved = sum(t.numel() * t.element_size() for t in (*tensors_in((args, kwargs)), *results))
        place = placement.where()
        if place != "device":  # a copy over the link moves its destination; a host op what it reads and writes
            nbytes = sum(_nbytes(t) for t in results) if place != "host" else moved + _written_in_place(func, args)
            self.elsewhere_s[place] += nbytes / self._elsewhere[place]
            return out
        flops = op_flops(func, args, kwargs, out)
        dtype = results[0].dtype if results else torch.float32
        rate = self.flops_per_s.get(DTYPE_NAMES.get(dtype, "fp32"), self.flops_per_s["fp32"])
        self.flops += flops
        self.bytes += moved
        if self.kernels is not None:
            seconds, bound = self.kernels.op_seconds(func, args, kwargs, out, flops, moved, rate,
                                                     self.compute_efficiency, self.bytes_per_s)
        else:
            seconds, bound = max(flops / (rate * self.compute_efficiency), moved / self.bytes_per_s), "roofline"
        self.time_s += seconds + self.op_overhead_s
        self.time_by_bound[bound] += seconds + self.op_overhead_s
        return out
