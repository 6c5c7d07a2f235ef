"""The optimizer's param groups of a DCP checkpoint (settings and fqns), and the bytes items that write them.

FSDP2's `get_state_dict` stores them as bytes items, one per setting: nested by group index
(`optimizer.param_groups.<i>.<setting>`, and `.params`, the fqns), or flattened per parameter
(`optimizer.param_groups.<fqn>.<setting>`, torchtitan, `flatten_optimizer_state_dict=True`).
Each item is a `torch.save` archive of a plain value, read with an unpickler that refuses every
global. fsdpkit's form of the groups (the training state's `optimizer.groups`): a list of
`{"settings": {...}, "params": [fqn, ...]}`, tuples as lists.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable
from functools import partial
from typing import Any

from ...errors import DataCheckError

PARAM_GROUPS = "param_groups"
PARAMS = "params"


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DataCheckError(f"a param group setting names {module}.{name}; only plain values are read")

    def persistent_load(self, pid: Any) -> Any:
        raise DataCheckError("a param group setting holds a tensor; only plain values are read")


def plain_value(raw: bytes, *, where: str) -> Any:
    """The value a `torch.save` archive of a number, string, None or container holds."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                raise DataCheckError(f"{where}: not a torch.save archive (no data.pkl)")
            return _PlainUnpickler(io.BytesIO(archive.read(name))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise DataCheckError(f"{where}: unreadable param group setting ({error})") from None


def read_param_groups(keys: list[str], read: Callable[[str], bytes], *, optimizer_key: str) -> list[dict]:
    """fsdpkit's param groups from the DCP bytes items `keys` (read by `read(key)`)."""
    prefix = f"{optimizer_key}.{PARAM_GROUPS}." if optimizer_key else f"{PARAM_GROUPS}."
    nested: dict[int, dict[str, Any]] = {}  # insertion order is not the index order: sorted below
    flat: dict[str, dict[str, Any]] = {}
    for key in keys:
        if not key.startswith(prefix):
            continue
        head, _, setting = key[len(prefix) :].rpartition(".")
        value = plain_value(read(key), where=key)
        value = list(value) if isinstance(value, tuple) else value
        if head.isdigit():
            nested.setdefault(int(head), {})[setting] = value
        elif head:
            flat.setdefault(head, {})[setting] = value
    nested = dict(sorted(nested.items()))
    if nested:
        return [{"settings": {k: v for k, v in g.items() if k != PARAMS}, "params": list(g.get(PARAMS, []))} for g in nested.values()]
    groups: list[dict] = []
    for fqn, settings in flat.items():  # parameters with the same settings share a group
        same = next((g for g in groups if g["settings"] == settings), None)
        if same is None:
            groups.append({"settings": settings, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return groups


def param_group_items(groups: list[dict], saved: Callable[[Any], bytes]) -> list[tuple[tuple[str | int, ...], Callable[[], bytes]]]:
    """(path, bytes) of every param group setting in both of FSDP2's layouts, so `dcp.load`
    finds them with either `flatten_optimizer_state_dict` setting."""
    items: list[tuple[tuple[str | int, ...], Callable[[], bytes]]] = []
    for index, group in enumerate(groups):
        settings = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in group.get("settings", {}).items()}
        params = list(group.get(PARAMS, []))
        for key, value in {**settings, PARAMS: params}.items():
            items.append((("optimizer", PARAM_GROUPS, index, key), partial(saved, value)))
        for fqn in params:
            for key, value in settings.items():
                items.append((("optimizer", f"{PARAM_GROUPS}.{fqn}.{key}"), partial(saved, value)))
    return items
