"""A live sharded model and its optimizer <-> a checkpoint (torch): what training saves and
loads, on top of the torch-free format in fsdpkit.checkpoint.format.

- tensors        checkpoint bytes as torch tensors: dtype names, raw bytes, readers by element range
- optim_state    any torch optimizer's per-parameter state <-> the tensor table
- model_state    a sharded model and its optimizer <-> the tensor table
- background     what keeps an async save off the step: host buffers, thread priority, timings
- copy_order     the device-to-host copy on a stream of its own, which the next optimizer step waits for
- save_protocol  every rank's part in a save: begin, agree, write, commit
- checkpointer   the `Checkpointer`, save, load, weights from a checkpoint, checks before launch

Importing this package imports nothing; `fsdpkit.save`, `fsdpkit.load` and
`fsdpkit.Checkpointer` load it on first use.
"""
