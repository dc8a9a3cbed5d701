"""An export's output directory (`consolidate --hf`, `--adapter`): built beside OUT_DIR and renamed into place, so that
nothing appears under OUT_DIR until everything is written, and a failure leaves nothing behind."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


class ExportError(ValueError):
    """Bad input to an export, in one line: the command line prints it and exits 2."""


def check_target(out: Path) -> None:
    """OUT_DIR may be written: it does not exist, or is an empty directory (which the export replaces)."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory")


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh directory to write the export into, renamed to `out` when the block ends, removed if it fails.

    Beside OUT_DIR, so that the rename stays on one filesystem; made first, before a checkpoint's checksums are
    computed (minutes for a 70B checkpoint), so that an OUT_DIR that cannot be written fails at once. The name is
    this process's: one left by a killed export of the same pid is stale. An OSError is an ExportError."""
    tmp = out.parent / f".{out.name}.{os.getpid()}.partial"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror}") from None
    try:
        yield tmp
        os.replace(tmp, out)  # an empty OUT_DIR is replaced; never a half-written one under the real name
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:  # a changed or corrupt checkpoint, an interrupt: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
