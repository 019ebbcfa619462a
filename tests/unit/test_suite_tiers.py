"""The suite's own bookkeeping: each test carries the tier marker of its folder and no other, the ``megatron``
marker is on exactly the files that need megatron-core, and the tolerance table names each key once."""

import ast
import re
from pathlib import Path

import actorcore.testing.tolerances as tolerances

TESTS_DIR = Path(__file__).resolve().parents[1]
TIERS = ("unit", "dist", "gpu", "verl")
# Needs megatron-core: an import of megatron anywhere in the file, or pytest.importorskip("megatron...").
USES_MEGATRON = re.compile(r"^\s*(from|import)\s+megatron\b|^[^#\n]*importorskip\(\s*[\"']megatron", re.M)


def test_every_collected_test_carries_its_folders_tier_and_no_other(request):
    items = request.session.items
    assert request.node in items
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS_DIR).parts[0]
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        assert tiers == [folder], f"{item.nodeid}: tier markers {tiers}, folder tests/{folder}"


def test_megatron_marker_is_on_the_files_that_need_megatron_core(request):
    uses = {}
    for item in request.session.items:
        path = Path(item.path)
        if path not in uses:
            uses[path] = bool(USES_MEGATRON.search(path.read_text(encoding="utf-8")))
        assert (item.get_closest_marker("megatron") is not None) == uses[path], item.nodeid
    # Known answers: megatron imported inside the tests; actorcore.mcore's pure-Python parts only; megatron only in
    # the text of a subprocess that checks it is NOT imported.
    assert USES_MEGATRON.search((TESTS_DIR / "unit/test_mcore_norm.py").read_text())
    assert not USES_MEGATRON.search((TESTS_DIR / "unit/test_mcore_rules.py").read_text())
    assert not USES_MEGATRON.search((TESTS_DIR / "unit/test_mcore_optional_dependency.py").read_text())


def test_tolerance_table_names_each_key_once():
    tree = ast.parse(Path(tolerances.__file__).read_text(encoding="utf-8"))
    keys = [k.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant)]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"tolerance keys defined twice in actorcore.testing.tolerances: {twice}"
    assert len(keys) == len(tolerances.TOL)  # every key is a literal of the one table
