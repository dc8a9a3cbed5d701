"""What evaluation costs a run: python -m train with --eval-every K against the same run without it.

A tokenizer is trained on the built-in corpus (tests/tokenizer.py), the corpus is prepared with
python -m train.prepare into train.bin/val.bin, and the same run is made with and without
evaluation, --repeat times each, interleaved. The cost per evaluation is the difference of the
runs' wall times (from metrics.jsonl's elapsed_s at the last step) over the number of
evaluations; it is also given as a multiple of one training step (the median time_s), and as
what it adds to each step at the given --eval-every. One evaluation is --eval-batches forward
passes of a global batch; a training step is a forward and a backward (about 3 forwards) plus
the optimizer.

    python benchmarks/eval_cost.py [--model gpt2-tiny] [--stage 3] [--steps 40] [--eval-every 10]
                                   [--eval-batches 8] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.tokenizer import train_tokenizer  # noqa: E402
from train.cli import main as train  # noqa: E402
from train.data import stdlib_files  # noqa: E402
from train.prepare import main as prepare  # noqa: E402


def prepared(root: Path, vocab: int) -> Path:
    docs = root / "docs"
    docs.mkdir()
    for i, path in enumerate(stdlib_files()[:400]):
        (docs / f"{i:04d}.txt").write_text(path.read_text(encoding="utf-8", errors="replace"))
    train_tokenizer(root / "tokenizer.json", [p.read_text() for p in sorted(docs.iterdir())[:100]], vocab_size=vocab)
    data = root / "data"
    assert prepare(["--tokenizer", str(root / "tokenizer.json"), "--out", str(data), "--val-fraction", "0.05",
                    str(docs)]) == 0
    return data


def run(flags: list[str], out: Path) -> tuple[float, float]:
    """(the run's elapsed seconds at its last step, the median step time)."""
    assert train(flags + ["--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["elapsed_s"], statistics.median(r["time_s"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = prepared(root, 256)
        common = ["--model", a.model, "--stage", str(a.stage), "--nproc", str(a.nproc), "--steps", str(a.steps),
                  "--seq", str(a.seq), "--data", str(data)]
        evaluated = ["--eval-every", str(a.eval_every), "--eval-batches", str(a.eval_batches)]
        plain, with_eval, steps = [], [], []
        for i in range(a.repeat):  # interleaved, so drift in the machine's load hits both alike
            t, s = run(common, root / f"plain{i}")
            plain.append(t)
            steps.append(s)
            with_eval.append(run(common + evaluated, root / f"eval{i}")[0])
    evaluations = a.steps // a.eval_every + (a.steps % a.eval_every != 0)
    step_s = statistics.median(steps)
    per_eval = (statistics.median(with_eval) - statistics.median(plain)) / evaluations
    print(f"{a.model}, stage {a.stage}, {a.nproc} ranks, {a.steps} steps of seq {a.seq}, "
          f"--eval-every {a.eval_every} --eval-batches {a.eval_batches}, median of {a.repeat}")
    print("| run | wall s (median) | per evaluation s | evaluation / training step | added per step |")
    print("|---|---|---|---|---|")
    print(f"| no evaluation | {statistics.median(plain):.2f} | | | |")
    print(f"| {evaluations} evaluations | {statistics.median(with_eval):.2f} | {per_eval:.3f} | "
          f"{per_eval / step_s:.2f} x ({step_s * 1000:.0f} ms step) | "
          f"{per_eval / a.eval_every / step_s:.1%} |")


if __name__ == "__main__":
    main()
