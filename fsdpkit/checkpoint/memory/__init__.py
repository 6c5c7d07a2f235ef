"""Snapshots: checkpoints that live in shared memory, so that a restarted group goes back one
snapshot interval rather than one disk checkpoint interval.

- store      one node's snapshot directory under a tmpfs (no torch): headers, checks, stale stores
- choice     which step a restarted group restores, and what moves between nodes (pure)
- writer     taking snapshots in the background, and the copy sent to a buddy on another node
- recovery   every rank's part in restoring one
"""
