"""The docs speak of the repository only: no numbers of a tracker outside it, no paths or links that leave it,
and every link of the benchmark summary reaches a dated run."""

import re

import pytest

from actorcore.testing.docs import REPO

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
