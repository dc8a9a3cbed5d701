import os
import sys

import torch.distributed as dist

from train.cli import main
from zerofunc.launch import under_torchrun

if __name__ == "__main__":
    code = main()
    if under_torchrun():
        # gloo can abort at interpreter exit after all work is done (DESIGN.md): end as the
        # spawned ranks do, destroying the group only after a run that ended well
        sys.stdout.flush(), sys.stderr.flush()
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)
