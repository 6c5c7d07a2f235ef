"""Does a checkpoint fit a model? Pure checks over the manifest, before any weight is read.

`check_compatible(manifest, expected, strict=...)`: `expected` maps each tensor the loader
wants (model parameters and buffers, and `optim.<state>.<param>` names) to its shape. Any
missing or extra model tensor, or any shape difference, is a `DataCheckError` naming the
first offending tensors; missing optimizer state is fatal only with `strict=True`.
Returns the names of expected optimizer tensors that are absent (for a warning).
"""

from __future__ import annotations

from ..errors import DataCheckError
from .format import is_optimizer_tensor
from .manifest import Manifest


def check_compatible(manifest: Manifest, expected: dict[str, tuple[int, ...]], *, strict: bool = True,
                     where: str = "checkpoint") -> list[str]:
    stored = {t.name: t.shape for t in manifest.tensors}
    for alias, target in manifest.aliases.items():
        stored.setdefault(alias, stored.get(target))
    wrong = [f"{name} {list(stored[name])} vs model {list(shape)}" for name, shape in expected.items()
             if name in stored and stored[name] is not None and tuple(stored[name]) != tuple(shape)]
    if wrong:
        raise DataCheckError(f"{where}: shapes differ from the model: {', '.join(wrong[:3])}"
                             + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    missing_model = [n for n in expected if n not in stored and not is_optimizer_tensor(n)]
    if missing_model:
        raise DataCheckError(f"{where}: missing model tensors {missing_model[:3]}"
                             + (f" (+{len(missing_model) - 3} more)" if len(missing_model) > 3 else "")
                             + " (a checkpoint of another model?)")
    extra = [n for n in stored if n not in expected and not is_optimizer_tensor(n) and n not in manifest.aliases]
    if extra:
        raise DataCheckError(f"{where}: tensors the model does not have: {extra[:3]}"
                             + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "") + " (a checkpoint of another model?)")
    missing_optim = [n for n in expected if n not in stored and is_optimizer_tensor(n)]
    if missing_optim and strict:
        raise DataCheckError(f"{where}: missing optimizer state {missing_optim[:3]}"
                             + (f" (+{len(missing_optim) - 3} more)" if len(missing_optim) > 3 else "")
                             + "; pass --no-strict to start the optimizer fresh")
    return missing_optim
