"""`diff A B`, spread: each tensor in both is one unit of the plan (its bytes in A), compared by
the rank it falls to with `offline.diff`'s own comparison; a rank reports a tensor that is not
bitwise equal as its one "problem" (the comparison, as JSON), and rank 0 puts the results back in
A's order, so the report is the one-process diff's."""

from __future__ import annotations

import json
from contextlib import ExitStack, closing
from pathlib import Path

from ..offline.diff import DiffRequest, Sides
from ..offline.formats import open_checkpoint
from .jobs import Progress, source_listing
from .plan import OutputFile, Part
from .staging import PartResult


class DiffJob:
    command = "diff"

    def __init__(self, src: str, request: DiffRequest):
        self.src, self.request = src, request
        model_key, optimizer_key = request.dcp_keys
        self.stack = ExitStack()
        try:
            a = self.stack.enter_context(open_checkpoint(src, model_key=model_key, optimizer_key=optimizer_key))
            b = self.stack.enter_context(open_checkpoint(request.b, model_key=model_key, optimizer_key=optimizer_key))
            self.sides = Sides(a, b, request)
            self.readers = self.sides.readers()
            for reader in self.readers:
                self.stack.enter_context(closing(reader))
        except BaseException:
            self.stack.close()
            raise
        self.files = [OutputFile(name, self.sides.tensors_a[name].nbytes) for name in self.sides.common]

    @property
    def source_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def facts(self) -> dict:
        options = {"model_only": self.request.model_only, "dcp_keys": self.request.dcp_keys}
        return {"command": "diff", "source": source_listing(self.src), "other": source_listing(self.request.b), **options}

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        name = self.files[part.file].name
        compared = self.sides.compare(self.readers, name)
        if progress is not None:
            progress(part.nbytes)
        found = [] if compared["status"] == "equal" else [json.dumps(compared)]
        return PartResult(part.file, part.index, name, part.begin, part.end, bytes_read=2 * part.nbytes, problems=found)

    def report(self, results: list[PartResult]) -> dict:
        compared = [
            json.loads(r.problems[0]) if r.problems else {"name": r.name, "status": "equal"} for r in sorted(results, key=lambda r: r.file)
        ]
        return self.sides.result(compared)

    def close(self) -> None:
        self.stack.close()
