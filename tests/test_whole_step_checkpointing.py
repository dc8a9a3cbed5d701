"""--compile whole with activation checkpointing (zerofunc/whole_step.py): a block the engine's
`ActivationCheckpointing` recomputes runs under torch's checkpoint inside the compiled step, so AOTAutograd's
partitioner saves less of it for backward and runs its matmuls again there.

Two properties, at stage 0 (the weights whole) and stage 3 (gathered, and gathered again in backward), over
2 gloo ranks, with accumulation and clipping (tests/test_whole_step.py's run, traced with aot_eager):
- in each mode it trains as the eager step with the same checkpointing, within tests/test_whole_step.py's
  derived 1e-5, and sends what that step sends, collective for collective;
- the checkpointing happens: the compiled backward's saved activations (what its forward saved for it besides
  the forward's inputs themselves, read from the graph) shrink from none to selective (one block in two) to
  full, selective-op (attention and every second matmul kept) lies between none and full, and each mode runs
  matmuls again in backward that the step without checkpointing does not. At stage 3, where the weights are
  gathered again rather than saved, the gathered-weights bound holds as without checkpointing (the root and
  two blocks at most, tests/test_whole_step.py), and no saved tensor is vocabulary-wide: the head
  recomputes them in backward, as the eager step's does (zerofunc/lm_head.py), where without checkpointing
  it keeps their log-softmax.
"""
from __future__ import annotations

import pytest

from tests.bare import in_world
from zerofunc.recompute import ActivationCheckpointing

MODES = {"none": ActivationCheckpointing(), "selective": ActivationCheckpointing("selective", 2),
         "selective-op": ActivationCheckpointing("selective-op"), "full": ActivationCheckpointing("full")}


def _per_mode(stage: int):
    from tests.test_whole_step import CFG, apart, sent, trained
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "aot_eager"
    out = {}
    for name, checkpointing in MODES.items():
        whole, whole_losses, whole_norms = trained(stage, "whole", checkpointing=checkpointing)
        backward = [g for g in whole.whole.graphs["loss"].graphs if g.phase == "backward"]
        gathered = max(g.peak_gathered_bytes for g in whole.whole.graphs["loss"].graphs)
        row = {"saved": sum(g.saved_bytes for g in backward), "matmuls": sum(g.matmuls for g in backward),
               "vocabulary_wide": [shape for g in backward for shape, _ in g.saved if shape[-1:] == (CFG.vocab_size,)],
               "gathered": gathered, "bound": 4 * (whole.units[0].layout.padded_numel
                                                   + 2 * whole.units[1].layout.padded_numel)}
        if name != "none":  # the step without checkpointing: tests/test_whole_step.py's
            eager, eager_losses, eager_norms = trained(stage, False, checkpointing=checkpointing)
            row.update(losses=apart(eager_losses, whole_losses), norms=apart(eager_norms, whole_norms),
                       params=apart(eager.full_parameters(), whole.full_parameters()),
                       same_ledger=sent(eager) == sent(whole))
        out[stage, name] = row
    return out


def _both_stages():
    return _per_mode(0) | _per_mode(3)


@pytest.mark.slow
def test_the_whole_step_checkpointed_trains_like_eager_and_recomputes():
    """The error bound is tests/test_whole_step.py's first test's, derived there: checkpointing recomputes
    the same ops on the same inputs, so it adds no reordering of its own (the eager step is bit for bit the
    same with it in fp32: zerofunc/recompute.py). A whole step that ignores checkpointing (tests/plants.py:
    whole_step_checkpointing_ignored) saves what it saves without it; one that recomputes a selective-op
    block whole (whole_step_selective_op_keeps_nothing) saves what full saves; a compiled head that keeps
    its logits under checkpointing (compiled_head_keeps_its_logits) saves their log-softmax."""
    # 8 engines compiled whole in one process: each compiles its own graphs (zerofunc/compiled_graphs.py,
    # with_own_code), so none is past dynamo's recompile_limit
    rows = in_world(2, _both_stages)[0]
    for stage in (0, 3):
        row = {name: rows[stage, name] for name in MODES}
        for name in ("selective", "selective-op", "full"):
            r = row[name]
            assert r["same_ledger"], f"stage {stage}, {name}: the compiled step sent other collectives than eager"
            for what in ("losses", "norms", "params"):
                assert r[what] <= 1e-5, f"stage {stage}, {name}: {what} differ by {r[what]:.1e}"
            assert r["matmuls"] > row["none"]["matmuls"], \
                f"stage {stage}, {name}: no matmul runs again in backward ({r['matmuls']} against none's)"
        saved = {name: r["saved"] for name, r in row.items()}
        assert saved["none"] > saved["selective"] > saved["full"], f"stage {stage}: saved bytes {saved}"
        assert saved["none"] > saved["selective-op"] > saved["full"], f"stage {stage}: saved bytes {saved}"
        if stage == 3:  # the weights gathered again in backward, not saved: what is saved is activations
            for name, r in row.items():
                assert r["gathered"] <= r["bound"], \
                    f"{name}: {r['gathered']} bytes gathered at once, over the bound ({r['bound']})"
                # the head's logits (their log-softmax, fp32) kept without checkpointing, recomputed with it
                assert bool(r["vocabulary_wide"]) == (name == "none"), f"{name}: saved {r['vocabulary_wide']}"
