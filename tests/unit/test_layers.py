"""The layers of DESIGN.md, read from the source's own import statements (nothing is imported).

Each module belongs to one layer and imports only from its own layer or the ones below it; the two routes
(``hf``, ``mcore``) and the weight export (``export``) do not import each other; ``kernels`` imports nothing of
actorcore outside itself but the result types (``actorcore.outputs``); nothing outside ``actorcore.testing``
imports it.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "actorcore"

# Lowest first. A module's layer is that of the longest prefix listed here.
LAYERS = [
    {"actorcore.batch", "actorcore.buckets", "actorcore.context_split", "actorcore.errors", "actorcore.outputs",
     "actorcore.model_files", "actorcore.lifecycle", "actorcore.sizes", "actorcore.visual_merge", "actorcore._moved"},
    {"actorcore.kernels"},
    {"actorcore.parallel"},
    {"actorcore.archs"},
    {"actorcore.hf", "actorcore.mcore", "actorcore.export"},
    {"actorcore.compat", "actorcore.cli", "actorcore.__main__", "actorcore.engines"},
]
SEPARATE = [("actorcore.hf", "actorcore.mcore"), ("actorcore.export", "actorcore.hf"),
            ("actorcore.export", "actorcore.mcore")]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ("actorcore",) + path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("actorcore.")}


def _area(module: str) -> str | None:
    areas = [a for layer in LAYERS for a in layer if module == a or module.startswith(a + ".")]
    return max(areas, key=len) if areas else None


def _layer(module: str) -> int:
    area = _area(module)
    return next(i for i, layer in enumerate(LAYERS) if area in layer)


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m != "actorcore" and not m.startswith("actorcore.testing")
                and _area(m) is None]
    assert not unplaced, f"modules outside every layer of DESIGN.md (add them to LAYERS): {unplaced}"


def test_imports_point_down():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name == "actorcore" or name.startswith("actorcore.testing") or _area(name) is None:
            continue
        for target in _imports(name, path):
            if target.startswith("actorcore.testing"):
                wrong.append(f"{name} imports {target} (test support)")
            elif _area(target) is not None and _layer(target) > _layer(name):
                wrong.append(f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})")
            for a, b in SEPARATE:
                if {_area(name), _area(target)} == {a, b}:
                    wrong.append(f"{name} imports {target}: the routes (hf, mcore, export) do not import each other")
    assert not wrong, "\n".join(wrong)


# What kernels may import of actorcore besides themselves: the result types (plain dataclasses over torch tensors).
KERNEL_IMPORTS_ALLOWED = ("actorcore.kernels", "actorcore.outputs")


def test_kernels_import_only_kernels():
    modules = _modules()
    wrong = [f"{name} imports {t}" for name, path in modules.items() if name.startswith("actorcore.kernels")
             for t in _imports(name, path) if _area(t) is not None
             and not any(t == a or t.startswith(a + ".") for a in KERNEL_IMPORTS_ALLOWED)]
    assert not wrong, "kernels know nothing about models or collectives:\n" + "\n".join(wrong)
