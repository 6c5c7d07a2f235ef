"""Process groups across ranks: collectives, launching worker processes, fault injection, host facts."""
