"""The import layering (docs/DESIGN.md): model.py at the bottom, the core beside it (decode.py,
optim.py, muon.py), the packages above them (the harness/ that prepares and guards a run, the
export formats/), data/ above them, the scripts on top. Read from the source with ast (every
import, lazy ones too), so a circle or an arrow that runs back down shows here before it shows
as an ImportError."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "formats")  # below data/ and the scripts


def module_name(path):
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def project_modules():
    files = [REPO / f"{name}.py" for name in ("model", "model_checks", "baselines", "caches",
                                              "decode", "optim", "muon")]
    for package in (*PACKAGES, "data"):
        files += sorted((REPO / package).glob("*.py"))
    return {module_name(f): f for f in files if f.name != "__init__.py"}


def imports(path, known):
    """The project modules `path` imports, anywhere in it (a function's lazy import too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in known}
            found |= {node.module} & set(known)
    return found


def graph():
    known = project_modules()
    return {name: imports(path, known) for name, path in known.items()}


def test_no_import_circles():
    g = graph()

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in g[start])
    circles = sorted(m for m in g if reaches(m, m, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_imports_run_one_way_between_layers():
    """No package imports data/ (data/ imports harness/common), the harness never imports the
    export formats (an export is not part of preparing a run); model.py, at the bottom, imports
    only its siblings (baselines.py, caches.py, model_checks.py), which import nothing else of
    the project's."""
    g = graph()
    back = {m: sorted(d for d in deps if d.startswith("data.")) for m, deps in g.items()
            if m.split(".")[0] in PACKAGES}
    assert not {m: d for m, d in back.items() if d}
    to_formats = {m: sorted(d for d in deps if d.startswith("formats.")) for m, deps in g.items()
                  if m.startswith("harness.")}
    assert not {m: d for m, d in to_formats.items() if d}
    assert g["model"] <= {"baselines", "caches", "model_checks"}
    assert g["model_checks"] <= {"baselines"} and g["baselines"] == g["caches"] == set()


def test_the_shared_modules_import_only_lib_common():
    """harness/common.py (UserError and its one line) imports nothing of the project but, lazily
    under torchrun, harness/torchrun_errors.py; the config parser, the device resolver and the file
    writers import only harness/common.py, so any script takes one without the others."""
    g = graph()
    assert g["harness.common"] <= {"harness.torchrun_errors"}
    assert g["harness.flags"] == g["harness.device"] == g["harness.files"] == {"harness.common"}


def test_sampling_does_not_load_the_file_writers():
    """sample.py writes no file: no module it imports, lazily or not, defines the atomic
    writes (as harness/common.py did while it held them)."""
    known = project_modules()
    seen, todo = set(), list(imports(REPO / "sample.py", known))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += imports(known[name], known)
    writers = [m for m in seen if "def atomic_write(" in known[m].read_text()]
    assert "harness.load" in seen and not writers, writers
