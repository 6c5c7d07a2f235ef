"""The layout docs/development.md draws is the layout of the code: every package in its map
exists with exactly the modules the map names, every import stays within what the map allows
(so none runs back up), packages import each other without a cycle, a checkpoint format's
package imports only the shared layers, no private name crosses a module, few modules sit
loose at the top, and no function is longer than a screen."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "development.md"
ROW = re.compile(r"^\|\s*`([\w/]+/)`\s*\|([^|]*)\|([^|]*)\|([^|]*)\|\s*$")
TOP = "fsdpkit/"
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_FILES = 12


def layout_map() -> dict[str, tuple[set[str], set[str]]]:
    """{package folder: (its modules, the packages it may import)} from the map's table."""
    rows = {}
    for line in MAP.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            folder, modules, _what, imports = match.groups()
            rows[folder] = (set(re.findall(r"`(\w+)`", modules)), set(re.findall(r"`([\w/]+/)`", imports)))
    return rows


def package_folders() -> dict[str, set[str]]:
    """{folder: module names} for fsdpkit/, each package under it, and cli/."""
    folders = {}
    for init in [*(ROOT / "fsdpkit").rglob("__init__.py"), ROOT / "cli" / "__init__.py"]:
        folder = init.parent
        folders[folder.relative_to(ROOT).as_posix() + "/"] = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return folders


def owner(module: str, folders: set[str]) -> str:
    """The package folder a dotted module (or a name inside one) belongs to."""
    parts = module.replace("fsdpkit_cli", "cli").split(".")
    for end in range(len(parts), 0, -1):
        folder = "/".join(parts[:end]) + "/"
        if folder in folders:
            return folder
    raise AssertionError(f"{module} is in no package")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted target) of every fsdpkit import in one file, relative ones resolved."""
    relative = path.relative_to(ROOT).with_suffix("").parts
    package = list(relative[:-1])
    package[0] = "fsdpkit_cli" if package[0] == "cli" else package[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, target) for line, target in found if target.split(".")[0] in ("fsdpkit", "fsdpkit_cli")]


def test_the_map_names_every_package_and_module_and_nothing_else():
    mapped = {folder: modules for folder, (modules, _) in layout_map().items()}
    assert mapped == package_folders()


def package_imports(folders: set[str]) -> dict[str, dict[str, list[str]]]:
    """{folder: {imported folder: ["file:line imports target", ...]}} over the code itself."""
    found: dict[str, dict[str, list[str]]] = {folder: {} for folder in folders}
    for folder in folders:
        for path in sorted((ROOT / folder).glob("*.py")):
            for line, target in imports_of(path):
                target_folder = owner(target, folders)
                if target_folder != folder:
                    found[folder].setdefault(target_folder, []).append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return found


def test_every_import_is_one_the_map_allows():
    rows = layout_map()
    found = package_imports(set(rows))
    wrong = [
        f"{where} ({target} is not in {folder}'s row)"
        for folder, targets in found.items()
        for target, places in targets.items()
        if target not in rows[folder][1]
        for where in places
    ]
    assert not wrong, "\n".join(wrong)


def test_packages_import_each_other_without_a_cycle():
    edges = {folder: sorted(targets) for folder, targets in package_imports(set(layout_map())).items()}
    done: set[str] = set()

    def visit(folder: str, path: tuple[str, ...]) -> None:
        assert folder not in path, f"import cycle: {' -> '.join((*path, folder))}"
        if folder not in done:
            for target in edges[folder]:
                visit(target, (*path, folder))
            done.add(folder)

    for folder in sorted(edges):
        visit(folder, ())


CHECKPOINT = "fsdpkit/checkpoint/"
CHECKPOINT_LAYERS = {"core/", "torchfile/", "live/", "memory/", "offline/", "spread/", "storage/"}  # what is not one format's package
FORMAT_MAY_IMPORT = {"fsdpkit/", f"{CHECKPOINT}core/", f"{CHECKPOINT}storage/", f"{CHECKPOINT}torchfile/"}
BUILT_ON_DCP = {f"{CHECKPOINT}megatron/"}  # a format stored as DCP underneath reads it through dcp/


def test_a_format_package_imports_only_the_shared_layers():
    rows = layout_map()
    formats = [f for f in rows if f.startswith(CHECKPOINT) and f != CHECKPOINT and f.removeprefix(CHECKPOINT) not in CHECKPOINT_LAYERS]
    assert formats, "no format package found under fsdpkit/checkpoint/"
    allowed = {folder: FORMAT_MAY_IMPORT | ({f"{CHECKPOINT}dcp/"} if folder in BUILT_ON_DCP else set()) for folder in formats}
    wrong = {folder: sorted(rows[folder][1] - allowed[folder]) for folder in formats if rows[folder][1] - allowed[folder]}
    assert not wrong, wrong


def private_crossings(path: Path) -> list[str]:
    """`from module import _name` and `module._name` where the module is fsdpkit's (one file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()  # local names bound to fsdpkit modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__" and (node.level or (node.module or "").startswith("fsdpkit")):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
                elif alias.name.islower():
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name for alias in node.names if alias.name.startswith("fsdpkit"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    found = [
        line for path in sorted([*(ROOT / "fsdpkit").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]) for line in private_crossings(path)
    ]
    assert not found, "\n".join(found)


def test_few_modules_are_loose_at_the_top():
    loose = sorted(p.name for p in (ROOT / "fsdpkit").glob("*.py"))
    assert len(loose) <= MAX_TOP_LEVEL_FILES, loose


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted([*(ROOT / "fsdpkit").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {length} lines")
    assert not long, "\n".join(long)


def test_pyproject_installs_every_package():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(project["tool"]["setuptools"]["packages"])
    folders = {"fsdpkit_cli" if folder == "cli/" else folder.rstrip("/").replace("/", ".") for folder in package_folders()}
    assert listed == folders


FILE_READS = {"pread", "preadv", "read", "readv"}  # os's calls that read a file's bytes


def test_checkpoint_file_bytes_are_read_in_one_module():
    """Every byte of a checkpoint file is read through core/files.py (read_blocks, pread_into,
    read_exactly, read_some, its mappings) or the local storage face (storage/local.py): no other
    module calls os's reads itself."""
    found = []
    for path in sorted((ROOT / "fsdpkit" / "checkpoint").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in ("fsdpkit/checkpoint/core/files.py", "fsdpkit/checkpoint/storage/local.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr in FILE_READS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls os.{node.attr}")
    assert not found, "\n".join(found)


def test_every_fsdpkit_name_a_benchmark_imports_exists():
    """Benchmarks run by hand, not in the suite: a rename in the library must not leave one
    importing a name that is gone (in its code or in the code it hands a subprocess)."""
    import importlib.util

    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for module, grouped, names in re.findall(r"from (fsdpkit[\w.]*) import (?:\(([^)]*)\)|([\w, ]+))", path.read_text()):
            loaded = importlib.import_module(module)
            for name in filter(None, (n.strip() for n in (grouped or names).split(","))):
                submodule = hasattr(loaded, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
                if not hasattr(loaded, name) and not submodule:
                    missing.append(f"{path.name}: {module}.{name}")
    assert not missing, "\n".join(missing)


READER_PACKAGES = ("core", "offline", "dcp", "deepspeed", "megatron", "torchsave", "torchfile", "format")  # read checkpoints
LOCAL_IO_ALLOWED = {  # module -> why it may touch local files itself
    "fsdpkit/checkpoint/core/files.py": "the local fast path: pread, mapped windows, kernel copies",
    "fsdpkit/checkpoint/core/staging.py": "a local output directory staged, synced and renamed; no source bytes",
    "fsdpkit/checkpoint/format/lock.py": "the run lock and /proc, not checkpoint content",
    "fsdpkit/checkpoint/format/save_dir.py": "train's local save directory compared with --resume",
    "fsdpkit/checkpoint/megatron/shape.py": "--model hf:DIR names a local model directory, not a checkpoint",
}
PATH_READS = {"read_bytes", "read_text"}  # a Path's methods that read a file (and `open()` or `open("rb")`)
OS_READS = {"open", "fdopen", "scandir", "listdir", "walk", "stat", "lstat"}
OS_PATH_PURE = {"join", "basename", "dirname", "split", "splitext", "normpath", "sep"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT"}


def local_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each call in `tree` that reads a local file or lists a local directory
    itself: open() and os.open() other than for writing, mmap.mmap other than for writing, a
    Path's read_bytes/read_text/open, os's listings and stats, os.path's queries."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, text = node.func, ast.unparse(node)
        if isinstance(func, ast.Name) and func.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax")):
                found.append((node.lineno, "open()"))
        elif isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if (
                owner in ("os", "io")
                and func.attr in OS_READS
                and not (func.attr == "open" and WRITE_FLAGS & set(text.replace("os.", " ").split()))
            ):
                found.append((node.lineno, f"{owner}.{func.attr}"))
            elif owner == "mmap" and func.attr == "mmap" and "ACCESS_WRITE" not in text and not text.startswith("mmap.mmap(-1"):
                found.append((node.lineno, "mmap.mmap"))
            elif owner == "os.path" and func.attr not in OS_PATH_PURE:
                found.append((node.lineno, f"os.path.{func.attr}"))
            elif func.attr in PATH_READS and owner not in ("os", "io", "mmap") and not owner.endswith(("storage", "Storage")):
                found.append((node.lineno, f".{func.attr}()"))
            elif func.attr == "open" and (not node.args or isinstance(node.args[0], ast.Constant)):  # Path.open, not Format.open(path, ...)
                found.append((node.lineno, ".open()"))
    return sorted(found)


def test_checkpoint_content_is_read_through_the_storage_face_or_the_local_fast_path():
    """The readers of every format read a checkpoint through core/files.py (open_regular,
    read_regular, read_blocks, the byte engine's windows), which reads a local file or, for a
    checkpoint in a bucket, the storage face; and they ask for directories through the path they
    were given (a local Path or a StoredPath: is_dir, iterdir, glob). No reader opens, maps,
    lists or stats a file itself, so none can miss a bucket or read a local file in its place."""
    found = []
    for package in READER_PACKAGES:
        for path in sorted((ROOT / "fsdpkit" / "checkpoint" / package).glob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in LOCAL_IO_ALLOWED:
                found += [f"{name}:{line} {what}" for line, what in local_reads(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_local_reads_check_finds_what_it_is_for():
    planted = ast.parse(
        "with open(path) as f: f.read()\n"
        "open(path, 'rb')\n"
        "os.open(path, os.O_RDONLY)\n"
        "(path / 'latest').read_bytes()\n"
        "os.path.getsize(path)\n"
        "mmap.mmap(fd, 0, access=mmap.ACCESS_READ)\n"
        "os.listdir(path)\n"
        "with Path(path).open('rb') as f: f.read()\n"
    )
    assert [line for line, _ in local_reads(planted)] == [1, 2, 3, 4, 5, 6, 7, 8]
    harmless = ast.parse(
        "open(path, 'wb')\nos.open(path, os.O_WRONLY | os.O_CREAT)\nstorage.read('x')\nos.path.join(a, b)\n"
        "found.open(source, keys)\nmmap.mmap(-1, 4096)\n"
    )
    assert local_reads(harmless) == []
