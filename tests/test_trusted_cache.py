"""The cache folder is trusted only when private, and what is loaded from it only when it is what was built
(radixserve/trusted_cache.py): folder checks, the manifest's hashes, the C++ kernels rebuilt when their library was
changed, a GGUF conversion redone when its folder was, an untrusted cache refused before anything is loaded."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from radixserve import trusted_cache
from radixserve.kernels import cpp_build, invariant
from radixserve.trusted_cache import FOLDER_MANIFEST, UntrustedCache, check_private, private_dir, record, verify


def test_a_new_cache_folder_is_private_and_a_shared_one_is_refused(tmp_path):
    made = private_dir(tmp_path / "a" / "cache")
    assert (made.stat().st_mode & 0o777) == 0o700
    made.chmod(0o777)
    with pytest.raises(UntrustedCache, match="can be written by other users .*chmod go-w"):
        check_private(made)
    made.chmod(0o755)
    check_private(made)  # readable by others is fine: only writing matters
    (tmp_path / "a").chmod(0o777)  # a folder above it anyone may write, without the sticky bit
    with pytest.raises(UntrustedCache, match="which another user can write to"):
        check_private(made)
    (tmp_path / "a").chmod(0o1777)  # like /tmp: others may not replace what is ours
    check_private(made)


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")
def test_a_cache_folder_of_another_user_is_refused(tmp_path):
    folder = private_dir(tmp_path / "theirs")
    os.chown(folder, 12345, 12345)
    with pytest.raises(UntrustedCache, match="belongs to uid 12345"):
        check_private(folder)


def built_folder(root: Path) -> Path:
    tmp = root / "built.tmp"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"weights" * 100)
    (tmp / "config.json").write_text("{}")
    record(tmp / FOLDER_MANIFEST, {f.name: f for f in tmp.iterdir()})
    return tmp.rename(root / "built")


def test_a_folder_is_what_was_built_until_a_file_changes_or_appears(tmp_path):
    folder = built_folder(tmp_path)
    assert verify(folder, FOLDER_MANIFEST) is None
    weights = folder / "model.safetensors"
    weights.write_bytes(b"WEIGHTS" * 100)  # same size, other bytes
    assert "sha256 differs" in verify(folder, FOLDER_MANIFEST)
    weights.write_bytes(b"weights" * 100)  # back as built: a new identity, the same content
    assert verify(folder, FOLDER_MANIFEST) is None
    (folder / "tokenizer.json").write_text("{}")
    assert "files its build did not make: tokenizer.json" in verify(folder, FOLDER_MANIFEST)
    (folder / "tokenizer.json").unlink()
    (folder / "config.json").unlink()
    assert "missing" in verify(folder, FOLDER_MANIFEST)
    (folder / FOLDER_MANIFEST).unlink()
    assert "nothing says what was built" in verify(folder, FOLDER_MANIFEST)


def test_an_unchanged_file_is_not_hashed_again(tmp_path, monkeypatch):
    folder = built_folder(tmp_path)
    assert verify(folder, FOLDER_MANIFEST) is None  # the rename kept the files' identities
    seen = json.loads((folder / FOLDER_MANIFEST).read_text())

    def no_hashing(path):
        raise AssertionError(f"{path} was hashed again")
    monkeypatch.setattr(trusted_cache, "_sha256", no_hashing)
    assert verify(folder, FOLDER_MANIFEST) is None
    assert json.loads((folder / FOLDER_MANIFEST).read_text()) == seen


def test_a_changed_kernel_library_is_rebuilt_not_loaded(tmp_path, caplog):
    cache = tmp_path / "kernels"
    built = cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, cache, "probe")
    original = built.read_bytes()
    assert cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, cache, "probe") == built  # cached
    with open(built, "r+b") as f:  # someone patches the library in place
        f.seek(len(original) // 2)
        f.write(b"\xcc" * 16)
    with caplog.at_level(logging.WARNING):
        again = cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, cache, "probe")
    assert again == built and "rebuilding probe-" in caplog.text and "sha256 differs" in caplog.text
    assert verify(cache, f"{built.name}.manifest.json", listed_only=True) is None
    cache.chmod(0o777)
    with pytest.raises(cpp_build.NativeUnavailable, match="chmod go-w"):
        cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, cache, "probe")


class Converting(Exception):
    pass


def test_a_changed_gguf_conversion_is_converted_again_and_a_shared_cache_refused(tmp_path, monkeypatch):
    from radixserve.model import loader

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    gguf = loader.bundled_model_path()
    out = loader.converted_folder(gguf)
    private_dir(out.parent)
    tmp = built_folder(tmp_path)
    tmp.rename(out)
    assert loader.convert_gguf(gguf) == out  # as converted: loaded, nothing converted again

    def converting(*args, **kwargs):
        raise Converting
    monkeypatch.setattr("radixserve.model.gguf_convert.write_shards", converting)
    (out / "config.json").write_text('{"model_type": "llama", "auto_map": {}}')
    with pytest.raises(Converting):  # the changed folder was not returned: the conversion started over
        loader.convert_gguf(gguf)
    assert not out.exists()
    out.parent.chmod(0o777)
    with pytest.raises(UntrustedCache, match="chmod go-w"):
        loader.convert_gguf(gguf)


def test_conversions_of_gguf_files_since_moved_changed_or_deleted_are_removed(tmp_path, monkeypatch):
    import shutil

    from conftest import write_gguf

    from radixserve.model import loader

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    first = write_gguf(tmp_path / "a" / "tiny.gguf", {}, "llama")
    converted = loader.convert_gguf(first)
    assert json.loads((converted / loader.SOURCE_FILE).read_text())["path"] == str(first.resolve())
    assert verify(converted, FOLDER_MANIFEST) is None  # source.json is in the manifest like every other file
    kernels = private_dir(tmp_path / "cache" / "kernels")  # not a conversion: never touched
    (kernels / "cpu_decode-0.so").write_bytes(b"\0")

    (tmp_path / "b").mkdir()
    moved = Path(shutil.copy2(first, tmp_path / "b" / "tiny.gguf"))  # another venv's copy of the same file
    kept = loader.convert_gguf(moved)
    assert kept != converted and converted.exists()  # its source is still there: both stay
    first.unlink()
    changed_stat = moved.stat()
    os.utime(moved, ns=(changed_stat.st_atime_ns, changed_stat.st_mtime_ns + 10**9))  # rebuilt in place
    again = loader.convert_gguf(moved)
    assert again != kept and again.exists()
    assert not converted.exists() and not kept.exists()  # deleted source, and the file's older version
    assert (kernels / "cpu_decode-0.so").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(["kernels", again.name])
