"""Snapshots: checkpoints that live in shared memory, so that a restarted group goes back one
snapshot interval rather than one disk checkpoint interval.
"""
