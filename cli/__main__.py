"""`python -m fsdpkit_cli ...` is the `fsdpkit` command (its console script's entry); under torchrun each process is a worker:

torchrun --nproc-per-node 2 -m fsdpkit_cli train --steps 20
"""

from .entry import main

main()
