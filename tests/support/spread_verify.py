"""`verify` spread over 1 and 2 processes against the one-process verify of the same checkpoint:
the same stdout (the `--json` report less its `spread` figures) and exit code, and, with one byte
of one file changed, the same one error line and exit 3 naming that file."""

from __future__ import annotations

import json
from pathlib import Path

from support.checkpoint_files import run_cli


def _without_spread(stdout: str) -> dict:
    report = json.loads(stdout)
    report.pop("spread", None)
    return report


def assert_spread_verify_is_one_process(path: Path, victim: Path, offset: int) -> str:
    """Verify `path` in one process and spread; then flip the byte at `offset` of `victim` (a
    file of `path`) and verify again. Returns the error line."""
    for flags in ((), ("--json",)):
        one = run_cli("verify", path, *flags)
        assert one.exit_code == 0, one.output
        for nproc in ("1", "2"):
            spread = run_cli("verify", path, *flags, "--nproc-per-node", nproc)
            assert spread.exit_code == 0, spread.output
            same = _without_spread(spread.stdout) == _without_spread(one.stdout) if flags else spread.stdout == one.stdout
            assert same, (nproc, flags, spread.stdout, one.stdout)
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0xFF
    victim.write_bytes(bytes(data))
    one = run_cli("verify", path)
    spread = run_cli("verify", path, "--nproc-per-node", "2")
    errors = [[line for line in r.output.splitlines() if line.startswith("error:")] for r in (one, spread)]
    assert one.exit_code == spread.exit_code == 3 and len(errors[0]) == 1 and errors[0] == errors[1], (one.output, spread.output)
    assert victim.name in errors[0][0], errors[0]
    one_json, spread_json = run_cli("verify", path, "--json"), run_cli("verify", path, "--json", "--nproc-per-node", "2")
    assert one_json.exit_code == spread_json.exit_code == 3 and _without_spread(one_json.stdout) == _without_spread(spread_json.stdout)
    return errors[0][0]


def storage_offset(path: Path, key: str | None = None) -> int:
    """The offset of the middle byte of storage `key` (or the largest) in `path`, a torch.save zip (read by zipfile)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        stored = [i for i in archive.infolist() if "/data/" in i.filename]
        info = max(stored, key=lambda i: i.file_size) if key is None else next(i for i in stored if i.filename.endswith(f"/data/{key}"))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2
