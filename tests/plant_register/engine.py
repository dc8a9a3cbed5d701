"""The plant register: the engine: the review's plants (issue 30), equivalence, collectives, the levers."""
from __future__ import annotations

from tests.plant_register.common import Plant, ENG, HOOKS, RED, OPT, COMM, CKPT, REDUCED_AT_BOUNDARY, EQ1, EQ2, HYBRID2, SKIP_RESUME, FAST

PLANTS: list[Plant] = [
    # -- the review's plants (issue 30): caught by the tests issue 30 adds (tests/steps.py, test_hybrid, test_faults)
    Plant("adamw_first_moment_not_kept", OPT,
          "adamw_fused_(unit.master, unit.grad, unit.m, unit.v,", "adamw_fused_(unit.master, unit.grad, unit.m.clone(), unit.v,",
          "AdamW's first moment is never written back: every step starts from m = 0, momentum is lost",
          "issue 30 review", (EQ1,)),
    Plant("hybrid_grad_norm_over_replicas", OPT,
          '            sum_over_ranks(self.comm, stats)\n',
          '            sum_over_ranks(self.comm, stats)\n'
          '            if getattr(self, "replicas", None) is not None:\n'
          '                self.replicas.all_reduce(stats, tag="grad_norm", mean=False)\n',
          "hybrid sharding's gradient norm also sums over the replicas (sqrt(R) too large): clipping clips too hard",
          "issue 30 review", (HYBRID2,),
          also=((ENG, "                                      self.offload)\n",
                 "                                      self.offload)\n"
                 "        self.optimizer.replicas = self.replicas\n"),)),
    Plant("hybrid_replicas_every_micro_step", RED, REDUCED_AT_BOUNDARY,
          REDUCED_AT_BOUNDARY.replace("if boundary:", "if boundary or self.replicas is not None:"),
          "the replicas' all-reduce runs every micro-step: the same numbers for twice the traffic",
          "issue 30 review", (HYBRID2,)),
    Plant("hybrid_offload_before_replicas_average", RED,
          "        then = (lambda: self._to_host(unit)) if self.offload is not None else None\n",
          "        then = None\n"
          "        if self.offload is not None:  # down before the replicas' average\n"
          "            device_grad = unit.grad\n"
          "            self._to_host(unit)\n"
          "            host, unit.grad = unit.grad, device_grad\n"
          "            then = lambda: setattr(unit, 'grad', host)  # noqa: E731\n",
          "hybrid sharding with optimizer offload updates from the un-averaged gradient shard",
          "issue 30 review", (HYBRID2,)),
    Plant("resume_step_as_optimizer_steps", CKPT,
          'engine.state = OptimizerState(manifest["optimizer_steps"],', 'engine.state = OptimizerState(manifest["step"],',
          "after skipped steps a resume restores the training step as AdamW's step count: wrong bias corrections",
          "issue 30 review", (SKIP_RESUME,)),
    # -- equivalence (issues 2 and 22) -------------------------------------------------------------------
    Plant("gradients_summed_not_averaged", COMM,
          "return dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM", "return dist.ReduceOp.SUM",
          "gradients are summed over ranks, not averaged: N ranks train at N times the learning rate",
          "issue 2 note; issue 22 note (missing 1/N); TESTS.md", (HYBRID2,)),
    Plant("shard_boundary_off_by_one", "zerofunc/layout.py",
          "        start = rank * self.shard_numel\n", "        start = rank * self.shard_numel - (rank > 0)\n",
          "each rank's shard starts one element early: ranks overlap and one element is nobody's",
          "issue 22 note; TESTS.md", ("tests/test_layout.py",)),
    Plant("one_unit_reduction_skipped", RED,
          '        self._reducing.add(all_reduce_gradient(self.comm, unit.grad, async_op=self._reducing.overlaps(nbytes)), nbytes)\n',
          '        if unit.name != "":\n'
          '            self._reducing.add(all_reduce_gradient(self.comm, unit.grad, async_op=self._reducing.overlaps(nbytes)), nbytes)\n',
          "stage 0 never all-reduces the root unit's gradient: the embedding drifts apart on every rank",
          "issue 22 note; TESTS.md", (EQ2,)),
    Plant("clipping_before_the_reduction", ENG,
          "            self.reduction.add(unit, grad, boundary)\n",
          "            if self.optimizer.clip and grad.device.type != 'meta':  # each local gradient clipped on its own\n"
          "                grad = grad * min(1.0, self.optimizer.clip / (float(grad.norm()) + 1e-6))\n"
          "            self.reduction.add(unit, grad, boundary)\n",
          "each rank clips its local gradient by its own norm before the reduction, not the global one after it",
          "issue 22 note; TESTS.md", (EQ1,)),
    Plant("every_micro_step_a_boundary", "zerofunc/step.py",
          "boundary=i == len(micro_batches) - 1)", "boundary=True)",
          "with accumulation, stages 0-1 communicate every micro-step: K times the traffic",
          "issue 2 note", ("tests/test_ledger.py", *FAST),
          also=((ENG, "boundary=self.micro_step + 1 == self.grad_accum)", "boundary=True)"),)),
    Plant("stage3_blocks_kept_after_forward", HOOKS,
          "                if not self.gathering.in_backward:  # a recomputation's: its backward follows, and releases it\n"
          "                    self.gathering.leave(unit)\n",
          "",
          "stage 3 never frees a block after its forward: the whole model ends up gathered",
          "issue 2 note", ("tests/test_ledger.py::test_one_step_moves_the_paper_volumes[2]",)),
    Plant("dropout_from_the_global_rng", "zerofunc/models/gpt2.py",
          "    keep = torch.stack([\n"
          "        torch.rand(x.shape[1:], generator=torch.Generator().manual_seed((int(s) * 1_000_003 + site) % 2**63)) >= p\n"
          "        for s in sample_ids.tolist()])\n",
          "    keep = torch.rand(x.shape) >= p\n",
          "dropout masks come from each rank's global RNG: N ranks no longer train like one device",
          "issue 2 note", ("tests/test_equivalence.py", *FAST)),
    Plant("fp16_overflow_decided_per_rank", OPT,
          '            sum_over_ranks(self.comm, stats)\n',
          '            found = stats[1:].clone()\n'
          '            sum_over_ranks(self.comm, stats)\n'
          '            if scaler is not None:  # each rank judges its own gradients\n'
          '                stats[0:1] = torch.where(found > 0, stats[0:1], stats[0:1].nan_to_num(0.0, 0.0, 0.0))\n'
          '                stats[1:] = found\n',
          "an fp16 overflow on one rank skips the step on that rank only: the ranks' weights diverge",
          "issue 2 note", ("tests/test_mixed_precision.py::test_overflow_on_any_rank_skips_the_step_everywhere[1]",)),
    # -- collectives and their stand-ins (issues 13, 22) ---------------------------------------------------
    Plant("gather_filler_plus_zero", COMM,
          "            slots[:self.rank].fill_(-0.0)\n            slots[self.rank + 1:].fill_(-0.0)\n",
          "            slots[:self.rank].zero_()\n            slots[self.rank + 1:].zero_()\n",
          "an all-gather done as an all-reduce turns a gathered -0.0 into +0.0",
          "issue 22 note; TESTS.md", ("tests/test_ledger.py::test_a_stand_in_does_what_the_collective_it_stands_for_does",)),
    Plant("reduced_shard_not_copied_out", COMM,
          "then = None if out is None else (lambda: out.copy_(mine))", "then = None",
          "a reduce-scatter done as an all-reduce leaves the caller's shard unreduced",
          "issue 13 note; TESTS.md", ("tests/test_ledger.py::test_a_stand_in_does_what_the_collective_it_stands_for_does",)),
    Plant("own_slot_not_filled_before_broadcast", COMM,
          "        slots[self.rank].copy_(inp.view(-1))\n        if op == \"all_reduce\":",
          "        if op == \"all_reduce\":\n            slots[self.rank].copy_(inp.view(-1))",
          "an all-gather done as broadcasts sends each rank's slot before filling it: stale weights everywhere",
          "TESTS.md", ("tests/test_ledger.py::test_a_stand_in_does_what_the_collective_it_stands_for_does",)),
    # -- the levers (issue 11) -----------------------------------------------------------------------------
    Plant("offload_grad_scale_dropped", "zerofunc/offload.py",
          "            if grad_scale != 1.0:\n                grad.mul_(grad_scale)\n", "",
          "with optimizer offload the clip coefficient and 1/loss scale are never applied",
          "issue 11 note", ("tests/test_levers.py", *FAST)),
    Plant("recomputed_weights_perturbed", HOOKS,
          "        self.gathering.regather(unit)\n        unit.bound = bind(self.model, self._unit_views(unit))\n",
          "        self.gathering.regather(unit)\n"
          "        unit.bound = bind(self.model, {k: v * 1.001 for k, v in self._unit_views(unit).items()})\n",
          "activation checkpointing recomputes a block with other weights than its forward used",
          "issue 11 note", ("tests/test_equivalence.py", *FAST)),
    Plant("recompute_gathers_twice", HOOKS,
          "        self.gathering.regather(unit)\n        unit.bound = bind(self.model, self._unit_views(unit))\n",
          "        self.gathering.regather(unit)\n        self.gathering.release(unit)\n        self.gathering.regather(unit)\n"
          "        unit.bound = bind(self.model, self._unit_views(unit))\n",
          "stage 3 with checkpointing gathers each recomputed block twice: more traffic than planned",
          "issue 22 note", ("tests/test_levers.py::test_each_lever_is_planned_as_it_trains",)),
    Plant("lm_head_gradient_not_masked", "zerofunc/lm_head.py",
          "    return loss, grad.mul_(valid.unsqueeze(1))", "    return loss, grad",
          "ignored targets (-100, padding) still push gradients into the head",
          "issue 11 note", ("tests/test_lm_head.py",)),
    Plant("lm_head_scale_dropped", "zerofunc/lm_head.py",
          "d = grad.mul_(scale).to(weight.dtype)", "d = grad.to(weight.dtype)",
          "the head's gradient ignores the loss's scale and the token count", "issue 11 note", ("tests/test_lm_head.py",)),
    Plant("tied_embedding_rows_not_added", "zerofunc/lm_head.py",
          "return None, grad_weight.index_put_((idx.flatten(),), grad_embedded.flatten(0, -2), accumulate=True)",
          "return None, grad_weight",
          "a tied embedding gets only the head's gradient: the input embedding never learns",
          "issue 11 note", ("tests/test_lm_head.py",)),
    # -- issue 31's named plants ---------------------------------------------------------------------------
    Plant("reduce_scatter_after_update", ENG,
          "        self.reduction.drain()\n        self.gathering.end_backward()\n",
          "        self.gathering.end_backward()\n",
          "the gradients' reductions are finished after the update, not before it: the optimizer steps on the "
          "previous step's gradient shards (or none)",
          "issue 31", (EQ2,),
          also=((ENG, "        return self.optimizer.step(state, lr)\n",
                 "        after = self.optimizer.step(state, lr)\n        self.reduction.drain()\n        return after\n"),)),
    Plant("stage3_block_kept_past_its_backward", ENG,
          "            self.reduction.left_out(unit)\n        self.gathering.leave(unit)\n",
          "            self.reduction.left_out(unit)\n        if grad is None:\n            self.gathering.leave(unit)\n",
          "stage 3 keeps each block gathered from its backward to the end of the step: by then the whole model",
          "issue 31",
          ("tests/test_overlap.py::test_stage_3_holds_at_most_one_block_and_its_prefetch_gathered",)),
    # -- issue 31: any nn.Module: the units stage 3 gathers (zerofunc/api.py, default_units)
    Plant("units_from_module_lists_only", "zerofunc/api.py",
          "isinstance(m, (nn.ModuleList, nn.Sequential))", "isinstance(m, nn.ModuleList)",
          "a model whose blocks are an nn.Sequential (timm's vision transformers) gets no units: stage 3 gathers "
          "the whole model at once, so its memory is stage 2's", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_initialize_trains_any_module_like_one_device",)),
    Plant("units_split_a_tied_weight", "zerofunc/api.py",
          "all(holders[id(p)] == {f\"{name}.{child}\"} for p in m.parameters())]", "True]",
          "an embedding and the head tied to it, both in the stack of blocks, become two units: the tied weight is "
          "gathered with one of them only", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_initialize_trains_any_module_like_one_device",)),
    Plant("units_from_the_largest_stack_only", "zerofunc/api.py",
          "        if all(_apart(name, c) for c, _ in chosen) and _blocks_of_one_class(m):\n", "        if False:\n",
          "an encoder-decoder's smaller stack of blocks (T5's encoder, CLIP's text tower) is left in the root unit: "
          "stage 3 keeps it gathered all step", "issue 31 (any nn.Module)",
          ("tests/test_hf_two_stacks.py::test_every_stack_of_blocks_is_a_unit",
           "tests/test_api.py::test_initialize_trains_any_module_like_one_device[0-encoder-decoder-blocks7]")),
    Plant("units_taken_beside_the_blocks", "zerofunc/api.py",
          "    return bool(pa and pb) and not (f\"{pa}.\".startswith(f\"{pb}.\") or f\"{pb}.\".startswith(f\"{pa}.\"))\n",
          "    return True\n",
          "a stack beside the blocks' own (adapters each block is handed) becomes units too: its blocks run inside "
          "the blocks' and the model, which trained, is refused", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_a_stack_whose_blocks_run_inside_others_is_no_unit",)),
    Plant("unit_run_inside_another_unchecked", "zerofunc/block_hooks.py",
          "                if running is not None and not self.gathering.in_backward:\n",
          "                if False:\n",
          "a unit named to run inside another fails at the block's end with a message about tensors read other than "
          "through its arguments, which names neither unit nor the remedy", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_a_stack_whose_blocks_run_inside_others_is_no_unit",)),
    Plant("encoder_decoder_labels_counted_shifted", "zerofunc/step.py",
          "    if getattr(getattr(model, \"config\", None), \"is_encoder_decoder\", False):\n",
          "    return True\n    if False:\n",
          "every model's labels are counted as a causal LM's, the first of each row left out: T5Gemma, whose "
          "loss divides by that count, trains and logs a loss too large by count / (count - rows)",
          "issue 31 (any nn.Module)",
          ("tests/test_hf_two_stacks.py::test_two_stack_models_train_at_stage_3_as_at_stage_0_with_their_own_loss",)),
    Plant("loss_kwargs_refusal_ignored", "zerofunc/step.py",
          "    if accepts is not None:\n        return bool(accepts)\n", "",
          "a model that says its **kwargs do not reach its loss (Hugging Face's `accepts_loss_kwargs = False`) is "
          "handed num_items_in_batch all the same, which its forward passes on to modules that do not take it",
          "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_a_model_whose_loss_takes_no_keywords_gets_none",)),
    Plant("units_may_share_a_weight", "zerofunc/units.py",
          "            if group_of[id(p)] != uname:\n", "            if False:\n",
          "units a caller names that split a tied weight are taken: one of them is gathered without it, and the "
          "engine skips every step for gradients that are not finite", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_units_that_share_a_weight_are_refused",)),
    Plant("block_run_again_reduced_at_each_run", ENG,
          "                if unit is not None and segment.index == first_run[unit.name]:\n"
          "                    self._unit_done(unit, held.pop(unit.name, None), boundary)\n",
          "                if unit is not None:\n"
          "                    self._unit_done(unit, held.pop(unit.name, None), boundary)\n",
          "a block the forward runs more than once (weights shared across depth, as ALBERT's) is reduced at each "
          "run's segment: stage 0 all-reduces a gradient that later runs still add to, and trains it wrong",
          "issue 31 (any nn.Module)", ("tests/test_api.py::test_initialize_trains_any_module_like_one_device[0-reused-blocks3]",)),
    Plant("compiled_module_taken", "zerofunc/api.py",
          "    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):", "    if False:",
          "initialize takes torch.compile(model), whose first forward then fails deep inside dynamo on the engine's "
          "block hooks", "issue 31 (any nn.Module)", ("tests/test_api.py::test_initialize_refuses_a_compiled_module",)),
    Plant("block_weight_read_outside_unchecked", "zerofunc/tape.py",
          "            if type(a) is _PARAMETER and self._on_module_parameter is not None:",
          "            if False:",
          "a forward that reads a block's weight outside the block computes with the module's released placeholder "
          "and fails later, at some other op, on a meta tensor", "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_a_block_weight_read_outside_the_block_is_refused_in_one_line",)),
    Plant("block_not_run_at_the_boundary_left_unreduced", ENG,
          "            for unit in (u for u in self.gathering.blocks if boundary and u.name not in first_run):  # not run\n",
          "            for unit in ():\n",
          "a block the accumulation boundary's forward does not run (one run on longer sequences only) keeps the "
          "step's earlier micro-steps' gradient unreduced at stages 0-1, and the engine refuses the step",
          "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_initialize_trains_any_module_like_one_device[1-partly run-blocks4]",)),
    Plant("block_not_run_at_the_boundary_not_averaged_over_replicas", RED,
          "        elif unit.grad is not None:  # stages 2-3: reduce-scattered at an earlier micro-step\n"
          "            self._reduced_for_the_step(unit)\n",
          "        elif unit.grad is not None:  # stages 2-3: reduce-scattered at an earlier micro-step\n"
          "            pass\n",
          "under hybrid sharding, a block the accumulation boundary's forward does not run keeps its shard group's "
          "gradient: never averaged over the replicas (nor offloaded), each group steps it on its own data",
          "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_a_block_the_boundary_does_not_run_is_averaged_over_replicas_and_offloaded",)),
    Plant("prefetch_in_the_modules_order", "zerofunc/gather.py",
          "        order, here = self.order, len(self._runs) - 1\n",
          "        order, here = self.blocks, len(self._runs) - 1\n",
          "stage 3 prefetches the block after the computing one in the modules' order, not the forward's: a model "
          "that runs its blocks in another order gathers each block twice",
          "issue 31 (any nn.Module)", ("tests/test_overlap.py::test_stage_3_prefetches_in_the_order_the_forward_runs_its_blocks",)),
    Plant("stale_prefetch_kept", "zerofunc/gather.py",
          "            if stale is not unit and stale not in ahead:\n",
          "            if False:\n",
          "a block stage 3 prefetched and the forward did not run next stays gathered: a model that runs its blocks "
          "out of the modules' order ends up with all of them gathered at once",
          "issue 31 (any nn.Module)", ("tests/test_overlap.py::test_stage_3_prefetches_in_the_order_the_forward_runs_its_blocks",)),
    Plant("block_run_again_released_between_runs", "zerofunc/gather.py",
          "        if unit not in self._ahead:\n            self.release(unit, after_forward=self._forward)\n",
          "        self.release(unit, after_forward=self._forward)\n",
          "a block the forward runs twice in a row (weights shared across depth) is released and gathered again "
          "between its runs, in forward and in backward",
          "issue 31 (any nn.Module)", ("tests/test_overlap.py::test_stage_3_prefetches_in_the_order_the_forward_runs_its_blocks",)),
    Plant("ranks_running_different_blocks_unchecked", ENG,
          "            self._check_blocks_alike()  # under TORCH_DISTRIBUTED_DEBUG=DETAIL; before backward's first collective\n",
          "",
          "under TORCH_DISTRIBUTED_DEBUG=DETAIL, ranks whose forwards ran different blocks of one size go on into "
          "backward, where one block's reduction pairs with another's: wrong gradients, or a hang",
          "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_ranks_that_run_different_blocks_are_refused_under_detail_debugging",)),
    Plant("model_checkpointing_left_on", "zerofunc/recompute.py",
          "            + [(m, \"gradient_checkpointing\", False) for m in model.modules() if hasattr(m, \"gradient_checkpointing\")])\n",
          ")\n",
          "a Hugging Face model's own gradient checkpointing stays on in the engine's step: backward recomputes its "
          "layers outside the engine's forward, on the module's released (meta) weights, and fails",
          "issue 31 (any nn.Module)", ("tests/test_hf.py::test_hugging_face_models_checkpointed_train_like_one_device[gpt2-eager-own]",
                                       "tests/test_hf_two_stacks.py::test_two_stack_models_train_at_stage_3_as_at_stage_0_with_their_own_loss")),
    Plant("model_checkpointing_not_taken_over", "zerofunc/api.py",
          "    if not checkpointing.on and units and model_checkpoints(model):", "    if False:",
          "a model's own gradient checkpointing, off in the engine's step, is not taken over by the engine: it keeps "
          "every activation, the memory its user asked to save",
          "issue 31 (any nn.Module)", ("tests/test_hf.py::test_hugging_face_models_checkpointed_train_like_one_device[gpt2-eager-own]",)),
    Plant("block_called_directly_unhooked", HOOKS,
          "            if unit.bound is not None:\n                return forward(*args, **kwargs)\n",
          "            if True:\n                return forward(*args, **kwargs)\n",
          "a block whose forward method the model calls directly (block.forward(h)) runs without its hooks: on the "
          "module's released weights, and fails on a meta tensor",
          "issue 31 (any nn.Module)",
          ("tests/test_api.py::test_initialize_trains_any_module_like_one_device[0-called directly-blocks5]",)),
    Plant("block_recomputed_by_the_model_unhooked", ENG,
          "        with self.memory.category(\"activations\"), installed(self._forwards, self._pre_hooks, self._post_hooks,\n"
          "                                                            self._settings):\n",
          "        with self.memory.category(\"activations\"):\n",
          "a model that checkpoints its own blocks (torch.utils.checkpoint) recomputes them in backward without the "
          "engine's hooks: on the module's released weights, and fails on a meta tensor",
          "issue 31 (any nn.Module)", ("tests/test_api.py::test_initialize_trains_any_module_like_one_device[3-self-checkpointed-blocks6]",)),
    Plant("block_recomputed_by_the_model_entered_as_forward", HOOKS,
          "                if self.gathering.in_backward:\n", "                if False:\n",
          "a block the model's own checkpoint recomputes in backward is entered as in forward: counted as a run of "
          "the backward's order, which then loses its place",
          "issue 31 (any nn.Module)",
          ("tests/test_overlap.py::test_stage_3_prefetches_in_the_order_the_forward_runs_its_blocks[modules', "
           "checkpointed by the model-depth-1]",)),
]
