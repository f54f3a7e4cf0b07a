"""A torch.distributed.checkpoint reader that unpickles ``.metadata`` with only DCP's own classes allowed.

torch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a checkpoint directory nobody
vetted (``build`` and ``watch`` read whatever lands in ``--checkpoints``) could run any code the pickle
names. The tensors themselves are already read with ``torch.load(weights_only=True)``. Here the
metadata is read the same way torch reads it, but the unpickler resolves only what DCP's metadata
holds: the dataclasses of ``torch.distributed.checkpoint.metadata``, the file reader's
``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, and paths. Anything else is refused
before it is called.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata as dcp_meta

from policy_bundle.build.errors import CheckpointError

_EXTRA = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
          ("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          ("pathlib", "PosixPath"): Path, ("pathlib", "PurePosixPath"): Path,
          ("collections", "OrderedDict"): dict}


class UnsafeMetadataError(CheckpointError):
    """A ``.metadata`` pickle names something that is not part of DCP's metadata."""


def _allowed(module: str, name: str) -> Any:
    if (module, name) in _EXTRA:
        return _EXTRA[module, name]
    if module == dcp_meta.__name__:
        obj = getattr(dcp_meta, name, None)
        if isinstance(obj, type) and obj.__module__ == dcp_meta.__name__:
            return obj
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeMetadataError(f"policy.source: {self.where} refers to {module}.{name}, which DCP metadata "
                                      "never holds: refused without running it (not a checkpoint to trust)")
        return obj


def read_dcp_metadata(path: Path) -> dcp_meta.Metadata:
    """The ``Metadata`` pickled at ``path`` (a checkpoint's ``.metadata``), read with the restricted unpickler."""
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, str(path)).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, not a pickle, wrong protocol: all one answer
        raise CheckpointError(f"policy.source: {path} is not readable DCP metadata ({type(exc).__name__}: "
                              f"{exc})") from None
    if not isinstance(meta, dcp_meta.Metadata):
        raise CheckpointError(f"policy.source: {path} holds a {type(meta).__name__}, not DCP Metadata")
    return meta


class VettedFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose ``read_metadata`` uses ``read_dcp_metadata`` (as torch's does otherwise)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        meta = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_meta.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
