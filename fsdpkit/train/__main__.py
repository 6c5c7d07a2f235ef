"""`python -m fsdpkit.train [fsdpkit train flags]`; under torchrun each process is a worker:

    torchrun --nproc-per-node 2 -m fsdpkit.train --steps 10
"""

import sys

from fsdpkit_cli.app import app

if __name__ == "__main__":
    app(["train", *sys.argv[1:]], prog_name="fsdpkit")
