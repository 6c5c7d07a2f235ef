"""A live sharded model and its optimizer <-> a checkpoint (torch), on top of the torch-free
format in fsdpkit.checkpoint.format. Importing this package imports nothing; `fsdpkit.save`,
`fsdpkit.load` and `fsdpkit.Checkpointer` load it on first use.
"""
