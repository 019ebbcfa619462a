"""The docs speak of the repository only: no numbers of a tracker outside it, no paths or links that leave it,
and every link of the benchmark summary reaches a dated run."""

import re
from pathlib import Path

import pytest

from support.docs import REPO

DOCS = sorted(str(p.relative_to(REPO)) for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
# Our tracker's style ("issue 15", "item 2", "#12"); an upstream reference names its project (owner/repo#N, or
# "Liger PR #1370"), which cites public work.
TRACKER = re.compile(r"\b(?:issue|item)s? #?\d+|(?<![\w/.-])(?<!PR )#\d+", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS)
def test_no_tracker_numbers(doc):
    found = [m.group(0) for m in TRACKER.finditer((REPO / doc).read_text())]
    assert not found, f"{doc} refers to a tracker outside the repository: {found}"


@pytest.mark.parametrize("doc", DOCS)
def test_links_and_paths_stay_in_the_repository(doc):
    text = (REPO / doc).read_text()
    assert "../shared" not in text and "/work/" not in text, f"{doc} names a path outside the repository"
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = ((REPO / doc).parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{doc} links to {target}, which is not in the repository"


def test_every_summary_link_reaches_a_dated_run():
    summary = (REPO / "docs" / "benchmarks.md").read_text()
    log = (REPO / "docs" / "benchmark_log.md").read_text()
    anchors = re.findall(r"\(benchmark_log\.md#([\w-]+)\)", summary)
    assert len(anchors) >= 10
    missing = [a for a in anchors if f'<a id="{a}"></a>' not in log]
    assert not missing, f"benchmarks.md links to runs benchmark_log.md does not have: {missing}"


def test_the_docs_list_every_decoder_feature_and_option():
    """The feature table of docs/architecture.md names every decoder feature, docs/features.md every option keyword of
    ``patch_model``, the package docstring of ``hf.features`` every module of it, and ``hf/patch.py``'s docstring
    every option: adding a feature or an option without its docs fails here."""
    import actorcore.hf.features as features
    import actorcore.hf.patch as patch
    from actorcore.hf.features import DECODER_FEATURES
    from actorcore.hf.features.plan import option_keywords

    architecture = (REPO / "docs" / "architecture.md").read_text()
    missing = [f.name for f in DECODER_FEATURES if f"| `{f.name}` |" not in architecture]
    assert not missing, f"docs/architecture.md's decoder-feature table does not list {missing}"
    text = (REPO / "docs" / "features.md").read_text()
    keywords = option_keywords(DECODER_FEATURES)
    missing = [k for k in keywords if f"`{k}`" not in text]
    assert not missing, f"docs/features.md does not name the patch_model options {missing}"
    missing = [k for k in keywords if f"``{k}``" not in patch.__doc__ and f"``{k}=" not in patch.__doc__]
    assert not missing, f"hf/patch.py's docstring does not say what the options {missing} install"
    folder = REPO / "src" / "actorcore" / "hf" / "features"
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    missing = [m for m in modules if f"``{m}``" not in features.__doc__]
    assert not missing, f"hf/features/__init__.py's docstring does not name the modules {missing}"
    assert all(f"``{k}" in patch.patch_model.__doc__ for k in keywords)  # its docstring is built from the options


@pytest.mark.parametrize("package", ["actorcore.kernels", "actorcore.kernels.quack", "actorcore.mcore",
                                     "actorcore.mcore.build", "actorcore.mcore.run", "actorcore.mcore.convert",
                                     "actorcore.testing"])
def test_package_docstrings_name_every_module(package):
    """A package's docstring is its table of contents: it names every module and subpackage in it (adding one
    without saying what it is fails here)."""
    import importlib

    module = importlib.import_module(package)
    folder = REPO / "src" / Path(*package.split("."))
    names = sorted({p.stem for p in folder.glob("*.py") if p.stem != "__init__" and not p.stem.startswith("_")}
                   | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()})
    missing = [n for n in names if f"``{n}``" not in module.__doc__ and f"``{n}/``" not in module.__doc__]
    assert not missing, f"{package}'s docstring does not name {missing}"
