"""python -m zerofunc.consolidate DIR out.safetensors: a checkpoint's full fp32 weights, in one file.

DIR is a checkpoint directory or a run directory (its newest checkpoint is used). The
file loads into the plain model: model.load_state_dict(safetensors.torch.load_file(out)).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from zerofunc.checkpoint_files import CheckpointError, consolidated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerofunc.consolidate", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory")
    p.add_argument("out", help="the .safetensors file to write")
    a = p.parse_args(argv)
    try:
        weights = consolidated(a.checkpoint)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        save_file(weights, str(tmp))
        os.replace(tmp, out)  # never a half-written file under the real name
    except OSError as e:
        print(f"error: cannot write {out}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {len(weights)} tensors, {sum(t.numel() for t in weights.values()):,} parameters, to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
