"""What `verify` reports of a checkpoint, and what `convert` and `reshard` report of what they
wrote, in any format: one record each, the same keys in `--json` whatever the format, and one line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...sizes import count, format_size


@dataclass
class VerifyReport:
    path: str
    kind: str  # the format's name
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # what else the format counts: "file", "fragment", "chunk", "storage"...
    checked: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # other facts `--json` carries (a DCP checkpoint's serializations)

    def failed(self, problem: str) -> VerifyReport:
        """The report of a checkpoint that could not be opened."""
        self.problems.append(problem)
        return self

    def to_json(self) -> dict[str, Any]:
        """`--json`'s document: path, kind, ok, problems, tensors, bytes, each count under its
        plural ("files", "fragments", "chunks", "storages", "bytes_items"), checked, not_checked."""
        counts = {f"{name.replace(' ', '_')}s": value for name, value in self.counts.items()}
        return {
            "path": self.path,
            "kind": self.kind,
            "ok": self.ok,
            "problems": self.problems,
            "tensors": self.tensors,
            **counts,
            "bytes": self.bytes,
            "checked": self.checked,
            "not_checked": self.not_checked,
            **self.extra,
        }

    def summary_line(self) -> str:
        counted = "".join(f", {count(value, name)}" for name, value in self.counts.items())
        line = f"{self.kind}, {count(self.tensors, 'tensor')}{counted}, {format_size(self.bytes)}; checked: {'; '.join(self.checked)}"
        return line + (f"; not checked: {'; '.join(self.not_checked)}" if self.not_checked else "")


@dataclass(frozen=True)
class WriteReport:
    """What `convert` or `reshard` wrote; `details` holds what the target format adds (its world
    size, ZeRO stage, placement, dtype...), which `--json` carries beside the other keys."""

    src: str
    dst: str
    files: list[str]
    tensors: int
    bytes: int
    warnings: list[str]
    details: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            **self.details,
            "files": self.files,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "warnings": self.warnings,
        }

    def summary_line(self) -> str:
        return f"wrote {self.dst}: {count(len(self.files), 'file')}, {count(self.tensors, 'tensor')}, {format_size(self.bytes)}"
