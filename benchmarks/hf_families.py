"""Hugging Face causal LMs of many families through zerofunc.initialize, eager and compiled whole, side by side.

    python benchmarks/hf_families.py [--backend inductor|aot_eager] [--stages 0 3] [--families F ...] [--threads N]

"Any nn.Module the API accepts" (issue 31), held where tests cannot afford it: each family of
tests/hf_families.py (and GPT-2 and Llama, tests/test_hf.py's) at each stage, on one world of 2 gloo
ranks, 3 steps eager and 3 compiled whole (`"compile": "whole"`) from the same weights and batches.
Prints the last losses, averaged over the ranks, and the largest relative difference between the two
runs' losses: fp32 reordered by the compiler, so of the order of 1e-7 here. tests/test_whole_step.py holds
the step compiled whole to eager within 1e-5, and a row beyond it says so; a row beyond it, or a family
that fails (its error in one line), makes the script exit 1. `--threads`: torch's threads per rank.
`--backend aot_eager` traces and partitions as inductor does, without its C++ (minutes faster); inductor
compiles each family's graphs (about half a minute a family on 2 cores)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_families import LLAMA_LIKE, OTHER_FAMILIES  # noqa: E402

FAMILIES = ["gpt2", "llama", *OTHER_FAMILIES, *LLAMA_LIKE]
STEPS = 3
BOUND = 1e-5  # tests/test_whole_step.py's bound on the losses, compiled whole against eager


def run_rank(families: list[str], stages: list[int], backend: str, threads: int | None) -> dict:
    """Every (family, stage): the eager and compiled whole runs' losses (this rank's view of the global mean),
    or the error that stopped one."""
    import torch
    import transformers

    import zerofunc
    from tests.bare import OPTIM  # lr and eps chosen there so Adam does not amplify rounding
    from tests.test_hf import hf_model
    transformers.logging.set_verbosity_error()  # a config's unset `loss_type`, said by every model built
    if threads is not None:
        torch.set_num_threads(threads)
    from zerofunc.step import train_step
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = backend
    out = {}
    for family in families:
        for stage in stages:
            runs = []
            for compile in (False, "whole"):
                torch.manual_seed(0)
                try:
                    engine = zerofunc.initialize(hf_model(family), {
                        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": stage}, "compile": compile,
                        "optimizer": {"type": "AdamW", "params": {"lr": OPTIM.lr, "betas": list(OPTIM.betas),
                                                                  "eps": OPTIM.eps, "weight_decay": OPTIM.weight_decay}}})
                    g = torch.Generator().manual_seed(engine.comm.rank)
                    losses = []
                    for _ in range(STEPS):
                        ids = torch.randint(1, 53, (2, 11), generator=g)
                        losses.append(train_step(engine, [{"input_ids": ids, "labels": ids}]).item())
                    runs.append(losses)
                except Exception as e:  # noqa: BLE001  (a family's failure is a row, not the end of the sweep)
                    runs = f"{'compiled whole' if compile else 'eager'}: {type(e).__name__}: " \
                           f"{(str(e).splitlines() or [''])[0][:200]}"
                    break
            out[(family, stage)] = runs
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=range(4))
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: the launcher's)")
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES, metavar="FAMILY",
                    help=f"default: all ({' '.join(FAMILIES)})")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        print("error: transformers is not installed (pip install -e '.[test]')", file=sys.stderr)
        return 2
    from zerofunc.launch import RankError, spawn
    try:
        results = spawn(run_rank, 2, a.families, a.stages, a.backend, a.threads)
    except RankError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"2 gloo ranks, {STEPS} steps each way, compiled whole with {a.backend}; losses after step {STEPS}, "
          "averaged over the ranks")
    print(f"{'family':>10}  {'stage':>5}  {'eager':>9}  {'whole':>9}  {'largest difference':>18}")
    failed = False
    for key in results[0]:
        family, stage = key
        per_rank = [r[key] for r in results]
        if any(isinstance(r, str) for r in per_rank):
            failed = True
            print(f"{family:>10}  {stage:>5}  {next(r for r in per_rank if isinstance(r, str))}")
            continue
        eager = [sum(r[0][i] for r in per_rank) / len(per_rank) for i in range(STEPS)]
        whole = [sum(r[1][i] for r in per_rank) / len(per_rank) for i in range(STEPS)]
        apart = max(abs(w - e) / abs(e) for e, w in zip(eager, whole))
        beyond = apart > BOUND
        failed |= beyond
        print(f"{family:>10}  {stage:>5}  {eager[-1]:>9.6f}  {whole[-1]:>9.6f}  {apart:>18.1e}"
              + (f"  beyond {BOUND:.0e}" if beyond else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
