"""The core every checkpoint format shares (no torch): the tensor table (`SourceTensor`), the byte
engine that copies, casts and checksums its ranges, the local file reads and writes under it, the
reader of any format (`AnyCheckpoint`), the reports every format gives (verify, inspect, write),
the convert request and `Format`, the protocol each format package implements. Nothing here
imports a format's package or a package above it; importing this package imports nothing.
"""
