"""The offline commands over every checkpoint format (convert, reshard, verify, inspect, diff,
`fsdpkit.open_checkpoint`): byte copies over fragments in bounded memory, without torch."""
