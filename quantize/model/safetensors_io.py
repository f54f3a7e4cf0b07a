"""safetensors without whole copies: tensors memory-mapped straight from a file, and a file written one tensor at a
time.

``safetensors.torch.load_file`` reads every tensor into new memory and ``save_file`` wants every tensor converted
before it writes: for a policy that is two or three copies of the model at once. Here a file's tensors are views
of a private (copy-on-write) memory map: nothing is read until a layer touches it, pages stay the page cache's
(the kernel can drop and re-read them), and an in-place change stays in this process. A write converts one tensor,
writes it and lets it go.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFormatError(ValueError):
    """A file that is not a readable safetensors file (names the file and what is wrong)."""


def read_header(path: Path) -> Tuple[Dict[str, dict], int]:
    """The header's tensor entries and the offset where the data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsFormatError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise SafetensorsFormatError(f"{path}: header length {n} is not plausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def mapped_tensors(path: Path) -> Dict[str, Tensor]:
    """Every tensor of ``path`` as a view of one private memory map of the file (no data read yet). The map lives
    as long as any of the tensors does."""
    header, start = read_header(path)
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > start else None
    out: Dict[str, Tensor] = {}
    for name, entry in header.items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which is not supported")
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * dtype.itemsize or start + end > size:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        offset = start + begin
        if offset % dtype.itemsize:  # an unaligned tensor cannot be viewed in place: read it (rare: old writers)
            out[name] = torch.frombuffer(bytearray(mm[offset:offset + end - begin]), dtype=dtype).view(shape)
            continue
        out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(shape)
    return out


def write_streaming(path: Path, shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
                    tensor_of: Callable[[str], Tensor], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a safetensors file whose tensors ``shapes`` names (shape, dtype), asking ``tensor_of(name)`` for each in
    turn and writing it before asking for the next: at most one converted tensor exists at a time."""
    header: Dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        count = 1
        for d in shape:
            count *= d
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + count * dtype.itemsize]}
        offset += count * dtype.itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in shapes.items():
            t = tensor_of(name).detach().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy
            del t


def shapes_of(named: Iterable[Tuple[str, Tensor]], dtype: torch.dtype) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """(shape, ``dtype``) per name, in order: the plan ``write_streaming`` writes."""
    return {name: (tuple(t.shape), dtype) for name, t in named}
