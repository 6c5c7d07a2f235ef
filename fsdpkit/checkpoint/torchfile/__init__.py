"""torch's file formats read and written without torch: what DCP, DeepSpeed and per-rank
`torch.save` checkpoints share.

- unpickler  the allow-list unpickler: torch's tensor and storage records as inert stand-ins
- pickler    pickles written opcode by opcode (protocol 2)
- archive    `torch.save` zip records' headers; one tensor as a whole archive
- zipread    a `torch.save` zip at a byte range: its records, a tensor inside its storage
- savefile   one `torch.save` file: its pickle, its storages as byte ranges, their CRC-32s
- rawout     one output file written from raw byte ranges of source files
"""
