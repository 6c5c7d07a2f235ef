"""The offline checkpoint commands: convert, reshard, verify, inspect. Byte copies over
fragments in bounded memory; none of them imports torch."""
