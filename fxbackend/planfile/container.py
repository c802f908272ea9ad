"""The container: a plan file's binary layout (docs/FORMAT.md, "Layout").

A 32-byte header (magic, format version, CRC-32 of the JSON section, the two section lengths,
little endian), the JSON document (UTF-8), then the weights (safetensors bytes).  This module
reads and writes the sections and checks the header, sizes and CRC; what the document says is
the codec's and the loader's to check.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

from .errors import ReplayError, short

__all__ = ["FORMAT_VERSION", "OLDEST_FORMAT_VERSION", "MAGIC", "HEADER", "write_sections",
           "read_sections", "read_file"]

#: the format version this fxbackend writes; :func:`fxbackend.load` reads every version from
#: :data:`OLDEST_FORMAT_VERSION` up to it (see docs/FORMAT.md, "Versioning")
FORMAT_VERSION = 1
OLDEST_FORMAT_VERSION = 1
#: the first 8 bytes of every plan file
MAGIC = b"FXBPLAN\x00"
#: magic, format version, CRC-32 of the JSON section, JSON length, weights length
HEADER = struct.Struct("<8sIIQQ")


def write_sections(path: str | os.PathLike, doc: dict, weights: bytes,
                   version: int = FORMAT_VERSION) -> None:
    """Write a plan file from its JSON document and safetensors bytes (the header and its
    CRC-32 are computed here).  :func:`fxbackend.save` is the way to write a plan; this is for
    tools (and tests) that rewrite files.  Written under a temporary name and renamed into
    place."""
    body = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")
    header = HEADER.pack(MAGIC, version, zlib.crc32(body), len(body), len(weights))
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(body)
            f.write(weights)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_sections(path: str | os.PathLike) -> tuple[int, dict, bytes]:
    """``(format version, JSON document, safetensors bytes)`` of a plan file, with the header,
    the sizes and the CRC-32 checked but the document not validated (tools and tests; raises
    :class:`ReplayError`)."""
    version, doc, blob, _ = read_file(path)
    return version, doc, blob


def read_file(path: str | os.PathLike) -> tuple[int, dict, bytes, int]:
    """``(format version, document in the current version's shape, weights bytes, file
    size)``; every failure a ReplayError."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            version, crc, n_json, n_weights = _header(path, f.read(HEADER.size))
            size = os.fstat(f.fileno()).st_size
            expected = HEADER.size + n_json + n_weights
            if size != expected:
                raise ReplayError(f"{path}: {'truncated' if size < expected else 'trailing data'}"
                                  f": the header says {expected} bytes, the file has {size}")
            body = f.read(n_json)
            blob = f.read(n_weights)
    except OSError as e:
        raise ReplayError(f"{path}: cannot read: {e}") from None
    if zlib.crc32(body) != crc:
        raise ReplayError(f"{path}: the graph section is corrupted (CRC-32 mismatch)")
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ReplayError(f"{path}: the graph section is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ReplayError(f"{path}: the graph section is not a JSON object")
    if doc.get("format") != "fxbackend-plan" or doc.get("format_version") != version:
        raise ReplayError(f"{path}: the graph section says format {short(doc.get('format'))} "
                          f"version {short(doc.get('format_version'))}, the header version "
                          f"{version}")
    return version, _upgrade(doc, version), blob, size


def _header(path: str, head: bytes) -> tuple[int, int, int, int]:
    """``(version, CRC-32, JSON length, weights length)`` from the header's bytes."""
    if len(head) < HEADER.size:
        raise ReplayError(f"{path}: truncated: {len(head)} bytes, shorter than the "
                          f"{HEADER.size}-byte header")
    magic, version, crc, n_json, n_weights = HEADER.unpack(head)
    if magic != MAGIC:
        raise ReplayError(f"{path}: not an fxbackend plan file (magic {magic!r}, expected "
                          f"{MAGIC!r})")
    if version > FORMAT_VERSION:
        raise ReplayError(f"{path}: format version {version} is newer than this fxbackend "
                          f"reads (versions {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}); "
                          f"upgrade fxbackend")
    if version < OLDEST_FORMAT_VERSION:
        raise ReplayError(f"{path}: format version {version} is not a version this fxbackend "
                          f"reads ({OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})")
    return version, crc, n_json, n_weights


def _upgrade(doc: dict, version: int) -> dict:
    """The document in the current version's shape.  Each format version adds one step here
    (version N -> N+1) and keeps its golden files in tests/golden/."""
    return doc
