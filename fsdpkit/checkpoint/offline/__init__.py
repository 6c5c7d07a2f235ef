"""The offline commands over every checkpoint format (convert, reshard, verify, inspect, diff,
`fsdpkit.open_checkpoint`): the registry of formats and the orchestration over it; the work is each
format's (core/protocol.py), byte copies over fragments in bounded memory, without torch."""
