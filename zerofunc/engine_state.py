"""Reading an engine's state back whole: each unit's shards gathered over the shard group and cut into
the model's parameters. For tests, checkpoints' users and export; not on the training step's path."""
from __future__ import annotations

from typing import Callable

import torch

from zerofunc.collectives import gather_weights
from zerofunc.units import Unit


class WholeState:
    """ZeroEngine's whole-state readers (it has `units`, `stage`, `comm` and `offload`)."""

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole and in fp32 (the masters; a frozen one, its stored value), on every rank."""
        out = self._unflatten(lambda u: u.master, sharded=self.stage.shard_optimizer)
        for unit in self.units:
            if unit.frozen is not None:
                frozen = self._whole(unit.frozen.layout, unit.frozen.params, self.stage.shard_params)
                out.update({k: v.float() for k, v in frozen.items()})
        return out

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradient of every parameter, whole (between backward and step)."""
        return self._unflatten(lambda u: u.grad, sharded=self.stage.shard_optimizer)

    @torch.no_grad()
    def full_moments(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """AdamW's first and second moments of every parameter, whole, on every rank (between steps)."""
        sharded = self.stage.shard_optimizer
        return self._unflatten(lambda u: u.m, sharded), self._unflatten(lambda u: u.v, sharded)

    def _unflatten(self, get: Callable[[Unit], torch.Tensor], sharded: bool) -> dict[str, torch.Tensor]:
        out = {}
        if self.offload is not None:
            self.offload.wait()
        for unit in self.units:
            if not unit.numel:  # every parameter of the unit frozen
                continue
            flat = get(unit).to(unit.params.device)  # an offloaded master is on the host
            out.update(self._whole(unit.layout, flat, sharded))
        return out

    def _whole(self, layout, flat: torch.Tensor, sharded: bool) -> dict[str, torch.Tensor]:
        """The parameters of `layout` from `flat`, this rank's shard of them (`sharded`, gathered over the shard
        group) or all of them, as copies."""
        if sharded:
            whole = torch.empty(layout.padded_numel, device=flat.device, dtype=flat.dtype)
            gather_weights(self.comm, whole, flat, "export")
            flat = whole
        return {k: v.clone() for k, v in layout.views(flat).items()}
