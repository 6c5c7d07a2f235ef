"""Names vulture reports as unused that a caller's signature needs.

Read by `vulture fsdpkit cli vulture_whitelist.py` (`make lint`); only true false positives
belong here.
"""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# Parameters of functions that replace or override another's: the caller passes them.
_.worker_group  # fsdpkit/dist/launch.py: torch's LocalElasticAgent._stop_workers(worker_group, ...)
_.category  # fsdpkit/log.py: warnings.showwarning(message, category, filename, lineno, ...)
_.lineno  # fsdpkit/log.py: warnings.showwarning
_.out_shape  # fsdpkit/flops.py: torch's flop counter passes out_shape= to every formula
