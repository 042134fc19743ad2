"""Hugging Face hub ids (``org/name``, ``org/name@revision``) found in the local HF cache; nothing is downloaded.

The cache is huggingface_hub's own (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub, read by
the library itself), looked up with ``local_files_only=True``: a model fetched once with ``hf download`` on a
machine with network, or a cache folder copied over, is served as it is.
"""
from __future__ import annotations

from pathlib import Path


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` reads as a hub id (``namespace/name``, optionally ``@revision``),
    else None. Whether a local path of that name exists is the caller's question: a path always wins."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, at, revision = text.partition("@")
    if repo_id.count("/") != 1 or (at and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps its cache in this process (its own reading of the environment)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (None: main). FileNotFoundError saying where it
    looked and what to do when the cache has no such snapshot; the network is never used."""
    from huggingface_hub import errors, snapshot_download

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2: a partial download
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except incomplete as exc:
        raise FileNotFoundError(f"{exc} (cache: {hub_cache_dir()})") from None
    except errors.LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        rev = f" --revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path, and the Hugging Face cache has no snapshot of it{at} (looked in "
            f"{hub_cache_dir()}, set by HF_HUB_CACHE or HF_HOME); radixserve never downloads. On a machine with "
            f"network run `hf download {repo_id}{rev}` (huggingface-cli download in older versions) and copy "
            "its cache over (point HF_HOME at it), or pass a local checkpoint folder or .gguf file") from None
