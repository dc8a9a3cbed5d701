"""ZeRO-Offload of the optimizer: the fp32 master, m and v of a rank's shard live in host memory,
and the AdamW update runs on the host CPU.

Per unit, the rank's shard has one host buffer in the weights' dtype, `unit.staging`
(pinned when the device is a GPU, so copies are DMA and can run asynchronously):
- the reduced gradient shard comes down into it the moment its reduce-scatter is done
  (`gradient_down`, during backward; on a GPU on a copy stream, behind compute);
- at the step the host reads it (as fp32), runs torch's fused CPU AdamW over the flat
  shard (one pass over param, grad, m, v; not the reference's seven), and writes the
  new weights, rounded to the weights' dtype, back into it;
- they go up to the device (`weights_up`, asynchronous on a GPU), while the host moves
  on to the next unit's update.

In fp32 the master itself goes up and the gradient needs no conversion. Under stage 3
the weights that go up are the rank's shard of the unit; under stages 1-2 they go into
the send buffer that the all-gather then spreads.

Everything here is placed (sim.placement), so the memory tracker counts the host
buffers as host memory and the roofline times the update at the host's rate and the
copies at the link's, on meta tensors as on real ones.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from sim.placement import placed
from zerofunc.optim import AdamWConfig


class OptimizerOffload:
    def __init__(self, device: torch.device, memory):
        self.device, self.memory = device, memory
        self.host = torch.device("meta") if device.type == "meta" else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # copies both ways, beside compute

    def zeros(self, numel: int, dtype: torch.dtype, category: str) -> torch.Tensor:
        """A host buffer, counted as host memory under `category`."""
        t = torch.zeros(numel, dtype=dtype, device=self.host, pin_memory=self.cuda)
        self.memory.track(t, category, host=True)
        return t

    def gradient_down(self, staging: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Start copying a reduced gradient shard into its host buffer; the buffer is the unit's gradient now."""
        with placed("d2h"), self._on_copy_stream(grad):
            staging.copy_(grad, non_blocking=self.cuda)
        return staging

    def wait(self) -> None:
        """Before the host reads any gradient: every copy down has landed."""
        if self.stream is not None:
            self.stream.synchronize()

    @torch.no_grad()
    def update(self, master: torch.Tensor, staging: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               cfg: AdamWConfig, lr: Optional[float], grad_scale: float, out: Optional[torch.Tensor]) -> None:
        """AdamW on the host of `master` with the gradient in `staging` times `grad_scale`; the new
        weights then go up into `out` (a device tensor), asynchronously on a GPU."""
        lr = cfg.lr if lr is None else lr
        with placed("host"):
            grad = staging if staging.dtype == torch.float32 else staging.float()
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
            steps = torch.full((), float(step), device=self.host)
            torch._fused_adamw_([master], [grad], [m], [v], [], [steps], amsgrad=False, lr=lr, beta1=cfg.betas[0],
                                beta2=cfg.betas[1], weight_decay=cfg.weight_decay, eps=cfg.eps, maximize=False)
            del grad
            if out is None:
                return
            up = master if out.dtype == master.dtype else staging.copy_(master)
        self.weights_up(out, up)

    def weights_up(self, out: torch.Tensor, host: torch.Tensor) -> None:
        with placed("h2d"), self._on_copy_stream(out):
            out.copy_(host, non_blocking=self.cuda)
        if self.stream is not None:  # what runs next on the device (the forward, an all-gather) waits for the copy
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _on_copy_stream(self, device_tensor: torch.Tensor):
        """On a GPU: the copy stream, after what the compute stream has queued for `device_tensor`."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        device_tensor.record_stream(self.stream)  # the allocator must not reuse it before the copy is done
        return torch.cuda.stream(self.stream)

