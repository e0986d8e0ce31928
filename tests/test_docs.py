"""The guides in docs/ and the README: links resolve inside the repository, and the guides'
Python examples run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
DOCUMENTS = sorted(
    {*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "dpcore").rglob("*.md")}
)
# A path a reader of the repository cannot open: a scratch or home folder, a design document
# that is not in the repository.
OUTSIDE = re.compile(r"(?<![\w.])/(?:work|tmp|home|root)/|design\.md|\.\./shared")


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve_inside_the_repository(page):
    for target, _ in LINK.findall(page.read_text()):
        assert "://" not in target, (page.name, target)  # nothing outside the repository
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), (page.name, target)
        assert ROOT in resolved.parents or resolved == ROOT, (page.name, target)


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_no_file_outside_the_repository(page):
    text = page.read_text()
    assert not OUTSIDE.findall(text), (page.name, OUTSIDE.findall(text))
    for target, _ in LINK.findall(text):
        if "://" in target:  # a web page (an upstream project), not a file
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), (page.name, target)
        assert ROOT in resolved.parents, (page.name, target)


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for guide in (ROOT / "docs").glob("*.md"):
        assert f"docs/{guide.name}" in readme, guide.name


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", sorted(p.name for p in (ROOT / "docs").glob("*.md") if _python_blocks(p))
)
def test_guide_examples_run(name, capsys):
    namespace: dict = {}
    for index, code in enumerate(_python_blocks(ROOT / "docs" / name)):
        exec(compile(code, f"docs/{name}[python block {index}]", "exec"), namespace)
