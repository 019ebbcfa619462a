"""One rule for every file actorcore opens from a model directory (``actorcore.model_files``): an index entry with
``..`` or an absolute path and a link resolving outside are refused by the Megatron reader and ``check_model_dir``
(what ``verify``, ``demo --model`` and ``convert`` call), while a Hugging Face cache snapshot's links into its
repository's ``blobs/`` are read. The CLI's exit codes for the same cases: test_cli_exit_codes.py."""

import json
import os

import pytest

from actorcore.errors import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from actorcore.testing.tiny_configs import build_tiny_model

    root = tmp_path_factory.mktemp("files")
    build_tiny_model("llama", seed=1).save_pretrained(root / "sharded", max_shard_size="100KB")
    return root


def _escaping_copy(saved, tmp_path, target_of):
    """A copy of the sharded model whose index names its first shard through ``target_of(outside_path)``."""
    d = tmp_path / "model"
    d.mkdir()
    for f in os.listdir(saved / "sharded"):
        (d / f).write_bytes((saved / "sharded" / f).read_bytes())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "elsewhere").mkdir()
    os.replace(d / first, tmp_path / "elsewhere" / first)
    entry = target_of(tmp_path / "elsewhere" / first)
    index["weight_map"] = {k: entry if v == first else v for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize("kind, match", [("dotdot", "climbs out"), ("absolute", "not a plain name"),
                                         ("link", "outside the model directory")])
def test_escaping_index_entries_and_links_are_refused_by_every_reader(saved, tmp_path, kind, match):
    pytest.importorskip("megatron.core")
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader

    def target_of(path):
        if kind == "dotdot":
            return f"../elsewhere/{path.name}"
        if kind == "absolute":
            return str(path)
        os.symlink(path, tmp_path / "model_link.safetensors")
        return "model_link.safetensors"

    d = _escaping_copy(saved, tmp_path, target_of)
    if kind == "link":
        os.replace(tmp_path / "model_link.safetensors", d / "model_link.safetensors")
    with pytest.raises(CheckpointError, match=match):
        SafetensorsReader(str(d))
    from actorcore.errors import CheckpointPathError
    from actorcore.model_files import check_model_dir

    with pytest.raises(CheckpointPathError, match=match):
        check_model_dir(str(d))


def test_a_hugging_face_cache_snapshot_reads_through_its_blob_links(saved, tmp_path):
    pytest.importorskip("megatron.core")
    from actorcore.errors import CheckpointPathError
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader
    from actorcore.model_files import check_model_dir

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for k, f in enumerate(sorted(os.listdir(saved / "sharded"))):
        (repo / "blobs" / f"hash{k}").write_bytes((saved / "sharded" / f).read_bytes())
        os.symlink(f"../../blobs/hash{k}", snapshot / f)  # as huggingface_hub lays a snapshot out
    check_model_dir(str(snapshot))
    assert len(SafetensorsReader(str(snapshot)).names()) == 21
    outside = tmp_path / "hub" / "models--org--other" / "blobs"
    outside.mkdir(parents=True)
    (outside / "x").write_text("{}")
    os.symlink("../../../models--org--other/blobs/x", snapshot / "tokenizer.json")  # another repo's blob
    with pytest.raises(CheckpointPathError, match="outside the model directory"):
        check_model_dir(str(snapshot))


def test_model_file_names_and_damaged_indexes(tmp_path):
    from actorcore.errors import CheckpointPathError
    from actorcore.model_files import check_model_dir, model_file

    (tmp_path / "a.safetensors").write_bytes(b"")
    assert model_file(str(tmp_path), "a.safetensors") == str(tmp_path / "a.safetensors")
    for bad in ("", "/etc/passwd", "sub/../../x", "..\\x"):
        with pytest.raises(CheckpointPathError):
            model_file(str(tmp_path), bad)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["not", "a", "map"]}')
    with pytest.raises(CheckpointError, match="not a valid index"):
        check_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        check_model_dir(str(tmp_path / "nothing"))
