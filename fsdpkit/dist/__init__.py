"""Process groups across ranks: collectives, launching worker processes, fault injection, host facts."""

MAX_PROCESSES_PER_NODE = 64  # what a launch starts per node at most
