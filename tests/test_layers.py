"""The package's layers: each module imports only from layers below its own (docs/architecture.md).

Read from the source with `ast`, so an import inside a function counts as one at the top of the
module: a lazy import that runs up the layers is still an arrow up.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lms"

# The layer of each package (or root module), bottom up. A module may import its own package and
# any package of a lower rank; two packages of one rank never import each other.
LAYERS = {
    "lms.core": 0,
    "lms.analysis": 1,
    "lms.runtime": 1,
    "lms.planning": 2,
    "lms.report": 2,
    "lms.orchestration": 3,
    "lms.harness": 4,
    "lms.integrations": 4,
    "lms.cli": 5,
    "lms.__main__": 6,
    "lms": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> tuple[str, int]:
    """The package ``module`` belongs to and its rank."""
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name, LAYERS[name]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, int, bool]]:
    """``(imported lms module, line, at module level)`` for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from lms.x import y` names module lms.x.y where y is a module, else lms.x.
            names = []
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (
                    (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                )
                is_package = (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                names.append(candidate if is_module or is_package else base)
        else:
            continue
        for name in names:
            if name == "lms" or name.startswith("lms."):
                found.append((name, node.lineno, id(node) in top_level))
    return found


def _all_imports() -> list[tuple[str, str, int, bool]]:
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for imported, line, top in _imports(path, module):
            rows.append((module, imported, line, top))
    return rows


def _wrong(rows: list[tuple[str, str, int, bool]]) -> list[str]:
    """The imports among ``rows`` that run up the layers or sideways."""
    wrong = []
    for module, imported, line, _ in rows:
        here, rank = _layer(module)
        there, other = _layer(imported)
        if here == there or other < rank:
            continue
        wrong.append(f"{module}:{line} imports {imported} ({there}, layer {other} >= {rank})")
    return wrong


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        _layer(_module_name(path))


def test_no_import_runs_up_or_sideways():
    wrong = _wrong(_all_imports())
    assert not wrong, "\n".join(wrong)


def test_the_core_never_touches_cuda():
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names.append(f"{node.value.id}.{node.attr}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names += [getattr(node, "module", None) or "", *(a.name for a in node.names)]
            assert not any(n.startswith("torch.cuda") for n in names), f"{path.name}:{node.lineno}"


@pytest.mark.parametrize("package", ["lms.core", "lms.analysis", "lms.planning"])
def test_a_lower_layer_imports_alone(package, tmp_path):
    """Importing a lower layer loads nothing above it (a subprocess, to start from no modules)."""
    import subprocess
    import sys

    code = (
        f"import sys, {package}\n"
        "print('\\n'.join(m for m in sys.modules if m == 'lms' or m.startswith('lms.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    rank = LAYERS[package]
    above = [m for m in out if m != "lms" and _layer(m)[1] >= rank and _layer(m)[0] != package]
    assert not above, f"importing {package} loaded {above}"


def test_the_check_sees_an_arrow_up(tmp_path):
    """A lazy import up, one at module level and one sideways are all caught."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from lms.core import units\n"
        "from lms.orchestration.tuning import tune_plan\n"
        "from lms.analysis import simulate\n"
        "def f():\n    from lms.harness.train import train\n"
    )
    rows = [
        ("lms.runtime.session", name, line, top)
        for name, line, top in _imports(source, "lms.runtime.session")
    ]
    wrong = _wrong(rows)
    assert [w.split()[2] for w in wrong] == [
        "lms.orchestration.tuning",
        "lms.analysis.simulate",
        "lms.harness.train",
    ]
