"""The plant register: the step compiled whole (zerofunc/whole_step.py, zerofunc/compiled_graphs.py)."""
from __future__ import annotations

from tests.plant_register.common import Plant

PLANTS: list[Plant] = [
    Plant("whole_step_sum_not_averaged", "zerofunc/whole_update.py",
          "            g = g / world  #", "            g = g  #",
          "the compiled step's collectives sum the ranks' gradients and nothing divides the sum: every stage "
          "compiled whole trains with N times the gradient",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("whole_step_backward_not_ledgered", "zerofunc/whole_step.py",
          '            self.graphs["loss"].backward_ran()\n', "",
          "the compiled step's backward graphs run but their collectives never reach the ledger: --compile whole "
          "reports stage 2-3 without their reduce-scatters and stage 3 without its backward gathers",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("whole_step_bucket_cap_ignored", "zerofunc/compiled_graphs.py",
          "            bucketing.bucket_all_gather(graph.owning_module, cap_mb)\n",
          "            bucketing.bucket_all_gather(graph.owning_module)\n",
          "the compiled step buckets gathers at inductor's default cap (2000 MB): stage 3 gathers the whole model "
          "at once, undoing ZeRO-3's memory",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_its_blocks_and_the_prefetched_gathered",)),
    Plant("trainer_runs_the_whole_step_under_the_tracker", "train/loop.py",
          "            with tracker if engine.whole is None else contextlib.nullcontext():\n",
          "            with tracker:\n",
          "the CPU trainer's memory tracker (a dispatch mode) is entered around the step compiled whole: torch.compile "
          "then runs it eagerly, silently, and --compile whole on CPU compiles nothing",
          "issue 31", ("tests/test_whole_step.py::test_the_trainer_compiles_the_step_whole_on_cpu",)),
    Plant("whole_step_ignores_the_stand_ins", "zerofunc/collectives.py",
          "    op = group.gather_op\n", '    op = "all_gather"\n',
          "the compiled step gathers with gloo's own all-gather where the eager step issues broadcasts: 2-5x "
          "slower on gloo, and its ledger is not the eager step's (nor the plan's)",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    # whole_step_stage_2_weights_a_view (collectives.py's ReducedGradient returning a view of the whole
    # weights, not a copy) was retired 2026-11-28: since da0c8a8 the weights go on through whole_weights.py's
    # _Unflattened, an autograd Function, and the view keeps its gradient across GPT-2's graph break (the
    # Hugging Face test trains as eager with it in; bisected, caught up to 99875da). Not a bug any more.
    Plant("whole_weights_gradients_misplaced", "zerofunc/whole_weights.py",
          "for (numel, _), g in zip(ctx.slots, grads)]", "for (numel, _), g in zip(ctx.slots[::-1], grads[::-1])]",
          "the compiled step concatenates a unit's parameter gradients in reverse order: each lands on another "
          "parameter's elements",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("whole_step_gathers_waited_at_once", "zerofunc/comm_schedule.py",
          "                _complete_before(completion, None, graph)\n", "                pass\n",
          "the compiled step waits for each gather where it is issued: the next block's gather, issued before a "
          "block computes, finishes before that compute starts, and stage 3's prefetch overlaps nothing",
          "issue 31", ("tests/test_comm_schedule.py::"
                       "test_a_gather_waited_for_where_it_is_issued_completes_where_its_weights_are_read",)),
    Plant("whole_step_gathers_issued_at_their_block", "zerofunc/comm_schedule.py",
          "        for k in range(gather_depth, len(gathers)):  # 2. issue each before the completion `depth` ahead of it\n",
          "        for k in ():\n",
          "the compiled step issues each block's gather where the forward runs the block, none ahead: stage 3's "
          "prefetch overlaps nothing",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_its_blocks_and_the_prefetched_gathered",)),
    Plant("whole_step_backward_gathers_unbounded", "zerofunc/comm_schedule.py",
          "            completion = gathers[k - gather_depth][1]\n", "            completion = gathers[0][1]\n",
          "the compiled step issues every gather at the start of its graph (inductor's raise_comms, unbounded): "
          "stage 3 holds the whole model gathered, forward and backward",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_its_blocks_and_the_prefetched_gathered",
           "tests/test_whole_step.py::test_stage_3_compiled_by_inductor_with_gloo_s_ops_trains_like_eager")),
    Plant("whole_step_reductions_waited_at_once", "zerofunc/comm_schedule.py",
          "            _complete_before(completion, issued[0], graph)\n", "            pass\n",
          "the compiled step waits for each gradient's reduction where it is issued: no stage overlaps a "
          "reduction with the next block's backward (nor, at stages 1-2, a gather of new weights with the next "
          "unit's AdamW)",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_its_blocks_and_the_prefetched_gathered",)),
    Plant("whole_step_reductions_issued_late", "zerofunc/comm_schedule.py",
          "                _issue_after_matmuls(collective, graph)\n", "                pass\n",
          "the compiled step issues a gradient's reduce-scatter where AOTAutograd left its sums, after the next "
          "block's matmuls: nothing is left to overlap it with",
          "issue 31", ("tests/test_comm_schedule.py::test_a_reduction_is_issued_as_soon_as_its_matmul_is_done",
                       "tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends")),
    Plant("whole_step_ranks_issue_apart", "zerofunc/broadcast_gather.py",
          "             for r in range(group.size())]\n", "             for r in sorted(range(group.size()), reverse=rank > 0)]\n",
          "the ranks of the compiled step issue a gather's broadcasts in different orders (as the overlap pass "
          "once moved them, ordered by id()): gloo pairs collectives by issue order, and the ranks hang",
          "issue 31", ("tests/test_whole_step.py::test_stage_3_compiled_by_inductor_with_gloo_s_ops_trains_like_eager",)),
    Plant("comm_schedule_moves_in_place_ops", "zerofunc/comm_schedule.py",
          "                    or _mutates(a):", "                    or False:",
          "the overlap pass moves a gradient's in-place op (inductor reinplaces index_put) ahead of a node that "
          "reads the buffer before the write: that node then reads the written value",
          "issue 31", ("tests/test_comm_schedule.py::test_a_reduction_is_not_issued_ahead_of_an_in_place_write_s_readers",)),
    Plant("whole_step_waits_reordered_back", "zerofunc/compiled_graphs.py",
          '**({"reorder_for_peak_memory": False} if self.schedule is not None else {})', "**({})",
          "inductor's peak-memory reordering stays on for the scheduled graphs: it puts every wait back right after "
          "its collective, and the code inductor generates overlaps nothing, whatever the pass did to the graph "
          "(as committed for a while in issue 31's seventh step)",
          "issue 31", ("tests/test_whole_step.py::test_compiled_stage_3_keeps_its_blocks_and_the_prefetched_gathered",)),
    Plant("whole_step_boundary_drops_accumulated", "zerofunc/collectives.py",
          "            grad = grad + accumulated\n", "            grad = grad\n",
          "stages 0-1 compiled whole reduce, in the accumulation boundary's backward, that micro-batch's gradient "
          "alone: the earlier micro-batches' are dropped",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("whole_step_boundary_reductions_not_overlapped", "zerofunc/whole_step.py",
          "                     if self.reduces_in_backward else None", "                     if self.stage.shard_grads else None",
          "stages 0-1 compiled whole wait for each gradient's reduction where it is issued, in the boundary's "
          "backward: none overlaps the backward of the units before it",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("whole_step_update_gathers_waited_at_once", "zerofunc/comm_schedule.py",
          "        _in_turn(gathers, graph)\n", "        pass\n",
          "the update's graph (stages 1-2) waits for each unit's gather of new weights where it is issued: none "
          "overlaps the next unit's AdamW",
          "issue 31", ("tests/test_comm_schedule.py::test_the_update_s_gathers_overlap_the_next_unit_s_adamw_and_write_back_at_once",)),
    Plant("whole_step_update_written_back_late", "zerofunc/comm_schedule.py",
          "            _written_back_at_once(completion, graph)\n", "            pass\n",
          "the update's graph (stages 1-2) writes each unit's gathered weights back at its end: every unit's gathered "
          "copy lives to it, the whole model twice",
          "issue 31", ("tests/test_comm_schedule.py::test_the_update_s_gathers_overlap_the_next_unit_s_adamw_and_write_back_at_once",)),
    Plant("comm_schedule_writes_back_over_a_reader", "zerofunc/comm_schedule.py",
          "            if all(where[r] < where[done] for r in dest.users if r is not write):",
          "            if True:",
          "the overlap pass moves a write-back of new weights ahead of a node that reads the old ones: that node "
          "reads the new",
          "issue 31", ("tests/test_comm_schedule.py::test_a_write_back_stays_after_a_reader_of_the_old_weights",)),
    Plant("whole_step_update_gathers_into_a_copy", "zerofunc/collectives.py",
          '    if group.gather_op == "broadcast":\n        broadcast_gather_into(', '    if False:\n        broadcast_gather_into(',
          "stages 1-2's compiled update gathers each unit's new weights into a fresh buffer and copies it over the "
          "weights: every gathered byte written twice more than the eager step writes it, and a fresh buffer's pages",
          "issue 31", ("tests/test_whole_step_update.py",)),
    Plant("whole_step_reduces_a_copy_of_each_gradient", "zerofunc/collectives.py",
          "    grad.copy_(summed(grad, group))\n", "    return reduced_gradient(grad, group, scatter)\n",
          "stages 0-1's reduce graph all-reduces each gradient through funcol's out-of-place op: inductor copies "
          "every gradient into a fresh buffer first, which the eager step does not (30m: 120 MB a step)",
          "issue 31", ("tests/test_whole_step_update.py::test_stages_0_and_1_reduce_each_gradient_where_it_lies",)),
    Plant("comm_schedule_writes_back_before_the_wait", "zerofunc/comm_schedule.py",
          "            done = max(completion, key=where.__getitem__)\n", "            done = c\n",
          "the overlap pass writes a gather's result back into the weights right after the node it copies: a gather "
          "broadcast into the weights is read through a getitem ahead of its wait, so where inductor does not drop "
          "the write (aot_eager) it copies slots still being received",
          "issue 31", ("tests/test_comm_schedule.py::test_the_update_s_gathers_overlap_the_next_unit_s_adamw_and_write_back_at_once",)),
    Plant("broadcast_gather_own_slot_unwritten", "zerofunc/broadcast_gather.py",
          "    whole[rank * n:(rank + 1) * n].copy_(shard)\n", "",
          "the compiled step's gather on gloo broadcasts each rank's slot before writing the rank's own shard into "
          "it: every rank receives uninitialized memory for that slot",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("broadcast_gather_ledgered_once", "zerofunc/compiled_graphs.py",
          "] * ranks\n", "]\n",
          "a gather the compiled step issues as one broadcast per rank enters the ledger as one broadcast: the "
          "ledger no longer holds what the eager step sends",
          "issue 31", ("tests/test_whole_step.py::test_the_whole_step_trains_like_eager_and_sends_what_it_sends",)),
    Plant("gathered_bound_reads_all_gathers_only", "zerofunc/compiled_graphs.py",
          "        if _gathers(op, functions):\n", "        if op == \"all_gather\":\n",
          "the compiled step's gathered-weights bound counts only all-gathers: on gloo, where a block is gathered "
          "by broadcasts, nothing checks that stage 3 keeps at most the prefetch depth of blocks gathered",
          "issue 31", ("tests/test_whole_step.py::test_stage_3_compiled_by_inductor_with_gloo_s_ops_trains_like_eager",)),
    Plant("whole_16_bit_weights_not_refreshed", "zerofunc/whole_update.py",
          "            elif span is None:  # 16-bit weights: the master's new rounding\n"
          "                unit.params.copy_(master)\n",
          "            elif span is None:  # 16-bit weights: the master's new rounding\n"
          "                pass\n",
          "bf16 training compiled whole at stages 0 and 3 updates the fp32 masters and never the bf16 weights the "
          "forward uses: the model stops learning", "issue 31", ("tests/test_whole_step_bf16.py",)),
    Plant("whole_16_bit_weights_not_gathered", "zerofunc/whole_update.py",
          "                gathered_into(unit.params, new.to(unit.params.dtype), groups[unit.name])\n",
          "                pass\n",
          "bf16 training compiled whole at stages 1-2 never gathers the updated masters into the weights", "issue 31",
          ("tests/test_whole_step_bf16.py",)),
    # -- activation checkpointing compiled whole ------------------------------------------------------------
    Plant("whole_step_checkpointing_ignored", "zerofunc/whole_step.py",
          "            if not recomputed:\n", "            if True:\n",
          "--compile whole with activation checkpointing keeps every block's activations: the lever does nothing",
          "whole-step checkpointing", ("tests/test_whole_step_checkpointing.py",)),
    Plant("whole_step_selective_op_keeps_nothing", "zerofunc/whole_step.py",
          '**({"context_fn": keep_attention_and_every_second_matmul} if keeps_ops else {}))', "**{})",
          "selective-op checkpointing compiled whole recomputes its blocks whole, keeping no attention or matmul "
          "output: it is full checkpointing under another name", "whole-step checkpointing", ("tests/test_whole_step_checkpointing.py",)),
    Plant("compiled_head_keeps_its_logits", "zerofunc/lm_head.py",
          "preserve_rng_state=False) if self.recompute\n",
          "preserve_rng_state=False) if False\n",
          "a compiled step with checkpointing on keeps the head's fp32 log-softmax from forward to backward, "
          "vocabulary-wide, where the eager step recomputes it", "whole-step checkpointing", ("tests/test_whole_step_checkpointing.py",)),
    Plant("compiled_head_takes_the_logits_whole", "zerofunc/lm_head.py",
          "            cols = chunk_columns(weight.shape[0], weight.shape[1])\n",
          "            cols = weight.shape[0]\n",
          "the traced step's head computes every token's logits over the whole vocabulary at once (Llama-3-8B at "
          "8,192 tokens: 4.2 GB of fp32), where the eager head and the plan take one chunk at a time", "issue 31",
          ("tests/test_whole_step_head.py",)),
    Plant("compiled_head_chunks_unaligned", "zerofunc/lm_head.py",
          "    return min(vocab, math.ceil(cols / COLUMN_ALIGNMENT) * COLUMN_ALIGNMENT)",
          "    return min(vocab, cols)",
          "the compiled head cuts the vocabulary evenly: gpt2-small's chunks are 10,061 entries, whose logits rows "
          "(20,122 bytes in bf16) a GPU's matmul writes and reads unaligned", "issue 31 note",
          ("tests/test_lm_head.py::test_the_compiled_head_cuts_the_vocabulary_into_aligned_chunks",)),
    Plant("compiled_head_cuts_the_tokens", "zerofunc/lm_head.py",
          "            for first, w in zip(range(0, weight.shape[0], cols), weight.split(cols)):\n"
          "                lse, target = (checkpoint(_vocabulary_chunk, h, w, t - first, use_reentrant=False,\n"
          "                                          preserve_rng_state=False) if self.recompute\n"
          "                               else _vocabulary_chunk(h, w, t - first))\n"
          "                lses.append(lse)\n"
          "                picked = picked + target\n"
          "            return ((torch.logsumexp(torch.stack(lses, dim=1), dim=1) - picked) * valid).sum() / count",
          "            def summed(h, weight, t):\n"
          "                z = nn.functional.linear(h, weight).float()\n"
          "                return nn.functional.cross_entropy(z, t, ignore_index=IGNORE_INDEX, reduction='sum')\n"
          "            parts = [summed(h[s:s + rows], weight, t[s:s + rows]) for s in range(0, h.shape[0], rows)]\n"
          "            return torch.stack(parts).sum() / count",
          "the traced head cuts the tokens, as the eager head does: the weight's gradient is then a sum of one "
          "vocabulary-by-width product per chunk, two of them alive at once in the compiled backward (gpt2-small: "
          "74 MiB more at the step's peak)", "issue 31 note", ("tests/test_whole_step_head.py",)),
    Plant("compiled_embedding_in_fp32", "zerofunc/compiled_graphs.py",
          "compile_fx(gm, example_inputs, decompositions=decompositions(), ",
          "compile_fx(gm, example_inputs, ",
          "an embedding's gradient compiled whole goes through torch's decomposition, which accumulates a 16-bit "
          "embedding's rows in a vocabulary-by-width fp32 buffer: tied, gpt2-small 147 MiB at the end of backward, "
          "where stages 1-2 compiled whole peaked; untied, Llama-3-8B 2.1 GB", "issue 31 note",
          ("tests/test_whole_step_head.py::test_the_compiled_embeddings_take_their_gradient_in_the_weight_s_dtype",)),
    # -- frozen parameters compiled whole ----------------------------------------------------------------
    Plant("whole_step_frozen_part_left_out", "zerofunc/whole_step.py",
          "        if unit.frozen is None:\n            return views\n", "        if True:\n            return views\n",
          "--compile whole leaves a unit's frozen parameters to the module's own tensors, which initialize left "
          "on the meta device: the compiled step fails (at stage 3 nothing would gather them)", "whole-step frozen",
          ("tests/test_frozen.py::test_frozen_parameters_compiled_whole_train_like_eager",)),
    Plant("whole_step_frozen_kept_from_forward", "zerofunc/whole_step.py",
          "regathered(gathered_frozen, frozen.params, self.frozen_groups[unit.name], slots)",
          "gathered_frozen(frozen.params, self.frozen_groups[unit.name], slots)",
          "stage 3 compiled whole keeps every block's gathered frozen weights (LoRA's base) from forward to "
          "backward: the whole model gathered at once", "whole-step frozen",
          ("tests/test_lora.py::test_the_trainer_trains_lora",)),
    Plant("whole_step_refuses_nothing", "zerofunc/whole_step.py",
          "    named = [name for name, on in levers.items() if on]\n", "    named = []\n",
          "--compile whole takes optimizer offload, hybrid sharding, hpZ, fp16 and an fp32 reduction of 16-bit "
          "gradients without a word, and trains without them or fails in the ranks", "whole-step levers",
          ("tests/test_compile.py::test_compile_whole_refuses_the_levers_it_lacks_in_one_line",)),
    Plant("harness_config_of_another_width", "benchmarks/models/gpt2-30m.json", '"n_embd": 640', '"n_embd": 768',
          "the GPU's 30m rows (the whole part with WHOLE_MODEL) run another model than the CPU harness's 30m, and "
          "the two are compared as one", "issue 31 note", ("tests/test_harness_models.py",)),
    Plant("whole_step_engines_share_compiled_code", "zerofunc/whole_step.py",
          "torch.compile(with_own_code(fn), backend=", "torch.compile(fn, backend=",
          "every engine compiled whole shares one cache of dynamo's: the ninth engine in a process (a notebook, a "
          "sweep) runs its step eagerly, and its ledger records none of the collectives it sends",
          "issue 31 (benchmarks/hf_families.py's sweep, 2026-11-28)",
          ("tests/test_whole_step_models.py::test_engines_past_dynamo_s_recompile_limit_are_compiled_too",)),
    Plant("whole_step_accumulated_added_at_each_run", "zerofunc/whole_step.py",
          "self._accumulated.pop(unit.name, None)", "self._accumulated.get(unit.name)",
          "compiled whole with the GPU's layout (stages 0-1 reduce in the boundary's backward), a block the forward "
          "runs three times gets the earlier micro-batches' gradient three times", "issue 31 (any nn.Module)",
          ("tests/test_whole_step_models.py::test_blocks_run_unevenly_compiled_whole_train_like_eager",)),
    Plant("comm_schedule_completes_above_what_it_reads", "zerofunc/comm_schedule.py",
          "        if where[first] > max([where[completion[0]], *read]):", "        if where[first] > where[completion[0]]:",
          "a block run more than once reduces its gradient at each run, the reductions complete as one, and the "
          "schedule moves that completion above a later run's reduction: the compiled backward fails as it runs",
          "issue 31 (any nn.Module)",
          ("tests/test_whole_step_models.py::test_blocks_run_unevenly_compiled_whole_train_like_eager",)),
    Plant("whole_step_left_out_sum_dropped", "zerofunc/whole_step.py",
          "            if summed is not None:\n                loss = LeftOutGradient",
          "            if False:\n                loss = LeftOutGradient",
          "compiled whole with the GPU's layout, a block the accumulation boundary's forward does not run loses the "
          "earlier micro-batches' gradient: it steps on zeros", "issue 31 (any nn.Module)",
          ("tests/test_whole_step_models.py::test_blocks_run_unevenly_compiled_whole_train_like_eager",)),
    Plant("whole_step_prefetch_in_the_modules_order", "zerofunc/whole_step.py",
          "        @functools.wraps(forward)\n        def run(*args, **kwargs):\n"
          "            weights = self._whole_weights(unit)\n",
          "        blocks = self.engine.gathering.blocks\n"
          "        ahead = blocks[blocks.index(unit) + 1:blocks.index(unit) + 1 + self.engine.overlap.prefetch_depth]\n\n"
          "        @functools.wraps(forward)\n        def run(*args, **kwargs):\n"
          "            weights = self._ahead_of.pop(unit.name, None) or self._whole_weights(unit)\n"
          "            if self.stage.shard_params:\n"
          "                for nxt in ahead:\n"
          "                    if nxt.name not in self._ahead_of:\n"
          "                        self._ahead_of[nxt.name] = self._whole_weights(nxt)\n",
          "the step compiled whole issues the next block's gather, in the modules' order, as a block starts: a model "
          "that leaves a block out gathers it for nothing and holds it to the graph's end",
          "issue 31 (any nn.Module)",
          ("tests/test_whole_step_models.py::test_stage_3_compiled_whole_gathers_in_the_order_the_forward_runs_its_blocks",),
          also=(("zerofunc/whole_step.py", "        root = self.engine._root\n",
                 "        root = self.engine._root\n        self._ahead_of = {}\n"),)),
]
