"""The one rule for every file actorcore opens from a model directory: it must stay inside that directory.

A model directory is data someone else may have written. Its index (``model.safetensors.index.json``) names the
shard files; a name with ``..``, an absolute name, or a symbolic link that resolves elsewhere would make the reader
open a file outside the model (another user's checkpoint, ``/etc/...``). So every name is checked here before it is
opened: ``model_file`` (one name), ``check_model_dir`` (what ``from_pretrained`` would open: every top-level file
and every file the index names, each opened as safetensors where it is one, so that a damaged file is a one-line
``CheckpointError`` before transformers meets it).

Allowed links: those resolving inside the directory itself, and for a Hugging Face cache snapshot
(``.../models--org--name/snapshots/<revision>/``, whose files are links to ``../../blobs/<hash>``) those
resolving inside that repository's cache folder (``models--org--name/``).
"""

from __future__ import annotations

import json
import os

from actorcore.errors import CheckpointError, CheckpointPathError
from actorcore.sizes import check_config_sizes

INDEX_SUFFIX = ".index.json"
_CACHE_REPO_PREFIXES = ("models--", "datasets--")


def allowed_roots(model_dir: str) -> list[str]:
    """Where the files of ``model_dir`` may resolve to: the directory itself and, for a Hugging Face cache
    snapshot, the cache folder of its repository."""
    real = os.path.realpath(model_dir)
    roots = [real]
    snapshots, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(_CACHE_REPO_PREFIXES):
        roots.append(repo)
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def model_file(model_dir: str, name: str, roots: list[str] | None = None) -> str:
    """The path of the file ``name`` (as a config or an index names it) of ``model_dir``, refused with a
    ``CheckpointPathError`` when it would lie outside the directory: an absolute name, a ``..`` part, or a
    symbolic link resolving outside (see the module docstring for the Hugging Face cache)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name:
        raise CheckpointPathError(f"{model_dir}: the file name {name!r} is not a plain name inside the model "
                                  "directory (absolute, empty or with a backslash): fix the index or config that "
                                  "names it")
    if ".." in name.split("/"):
        raise CheckpointPathError(f"{model_dir}: the file name {name!r} climbs out of the model directory ('..'): "
                                  "copy the file into the directory and name it plainly in the index")
    path = os.path.join(model_dir, name)
    target = os.path.realpath(path)
    roots = allowed_roots(model_dir) if roots is None else roots
    if not _inside(target, roots):
        raise CheckpointPathError(f"{path} is a link to {target}, outside the model directory: copy the file into "
                                  f"{model_dir} (or remove the link) if it belongs to the model")
    return path


def index_files(model_dir: str, index_name: str) -> list[str]:
    """The shard names an index file of ``model_dir`` lists (its ``weight_map`` values), each checked by
    ``model_file``; ``CheckpointError`` when the index is not one."""
    path = model_file(model_dir, index_name)
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a valid index with a weight_map of tensor -> file name "
                              f"({type(exc).__name__}: {exc})") from None
    roots = allowed_roots(model_dir)
    for name in names:
        model_file(model_dir, name, roots)
    return names


def check_safetensors_file(path: str) -> None:
    """Open ``path``'s header (safetensors checks the offsets against the file size and the declared shapes),
    so a truncated or forged file is a ``CheckpointError`` naming it rather than a traceback later."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            handle.keys()
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); the file "
                              "is damaged or truncated: copy or download it again") from None


def check_model_dir(model_dir: str) -> None:
    """Every file of ``model_dir`` that a loader (``from_pretrained`` included) may open stays inside it, every
    safetensors file it holds or its index names is readable, its ``config.json`` has sizes a model can have, and
    it is not a Megatron checkpoint; raises ``CheckpointError`` (or its ``CheckpointPathError``) naming the first
    file that is not, ``FileNotFoundError`` without the directory."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: no such model directory")  # local only: nothing is downloaded
    refuse_megatron_checkpoint(model_dir)
    roots = allowed_roots(model_dir)
    weights = set()
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.islink(path) or os.path.isfile(path):
            model_file(model_dir, name, roots)
        if name.endswith(".safetensors"):
            weights.add(name)
        elif name.endswith(".safetensors" + INDEX_SUFFIX):
            weights.update(index_files(model_dir, name))
    for name in sorted(weights):
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: listed in the model's index but missing: copy or download it")
        check_safetensors_file(path)
    _check_config_json(model_dir)


def _check_config_json(model_dir: str) -> None:
    """The sizes of ``config.json`` (``actorcore.sizes.check_config_sizes``), before transformers meets a head count
    of 0 (``ZeroDivisionError``) or Megatron a layer count of -1 ("math domain error"). A file that is not a JSON
    object is left to the loader's own message."""
    try:
        with open(model_file(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(config, dict):
        try:
            check_config_sizes(config)
        except ValueError as exc:
            raise CheckpointError(f"{model_dir}: {exc}") from None


def refuse_megatron_checkpoint(model_dir: str) -> None:
    """A Megatron distributed checkpoint (``actorcore convert hf-to-mcore``'s output: ``metadata.json`` naming a
    sharded backend, ``*.distcp`` shards, the HF config only in ``hf/``) where a Hugging Face model directory is
    expected: ``CheckpointError`` saying how to get one, rather than transformers' "Unrecognized model"."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    names = os.listdir(model_dir)
    sharded = any(name.endswith(".distcp") for name in names)
    try:
        with open(os.path.join(model_dir, "metadata.json")) as f:
            sharded = sharded or "sharded_backend" in json.load(f)
    except (OSError, ValueError, TypeError):
        pass
    if sharded:
        raise CheckpointError(f"{model_dir} is a Megatron distributed checkpoint, not a Hugging Face model directory "
                              f"(no config.json): convert it first with `actorcore convert mcore-to-hf {model_dir} "
                              "HF_DIR` and use HF_DIR")


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the safetensors files at the top of ``model_dir``, read from their headers
    (nothing is loaded); empty when there are none (a hub id, another format)."""
    from safetensors import safe_open

    if not os.path.isdir(model_dir):
        return {}
    roots = allowed_roots(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            path = model_file(model_dir, name, roots)
            check_safetensors_file(path)
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes
