"""experiments/ imports run one way: dev tools -> binaries' layer -> peers -> lib, and the
libraries (dpcore, dpcore_accounting) never import it."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
# What each part of dpcore_experiments may import from dpcore_experiments.
ALLOWED = {
    "lib": {"lib"},
    "peers": {"lib", "peers"},
    "binaries": {"lib", "peers"},
    "dev": {"lib", "peers", "dev"},
}


def _part(path: pathlib.Path) -> str:
    rel = path.relative_to(EXPERIMENTS).parts
    return rel[0] if len(rel) > 1 else "binaries"


def _imported(path: pathlib.Path) -> set[str]:
    """Absolute module names `path` imports (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _target(name: str) -> str | None:
    """The part of dpcore_experiments that `name` is in (None: outside it)."""
    parts = name.split(".")
    if parts[0] != "dpcore_experiments" or len(parts) == 1:
        return None
    if parts[1] in ALLOWED and (EXPERIMENTS / parts[1]).is_dir():
        return parts[1]
    return "binaries" if (EXPERIMENTS / f"{parts[1]}.py").exists() else None


def test_imports_run_one_way():
    wrong = []
    for path in sorted(EXPERIMENTS.rglob("*.py")):
        part = _part(path)
        for name in _imported(path):
            target = _target(name)
            if target is not None and target not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(ROOT)} ({part}) imports {name} ({target})")
    for package in ("dpcore", "dpcore_accounting"):
        for path in sorted((ROOT / package).rglob("*.py")):
            wrong += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in _imported(path)
                if n.split(".")[0] == "dpcore_experiments"
            ]
    assert not wrong, "\n".join(wrong)


def test_every_experiments_package_is_installed():
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"\[tool\.setuptools\]\s*packages = \[(.*?)\]", text, re.S)
    installed = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    on_disk = {
        ".".join(["dpcore_experiments", *p.parent.relative_to(EXPERIMENTS).parts])
        for p in EXPERIMENTS.rglob("__init__.py")
    }
    assert on_disk <= installed, sorted(on_disk - installed)
