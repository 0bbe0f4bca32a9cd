"""Compression codecs by name (`blosc-zstd`, `blosc-lz4`, `zstd`, `none`) and their zarr codec chains."""

from __future__ import annotations

from typing import Any

from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from storage.errors import StorageError

BLOSC_BLOCKSIZE = 1 << 20
# name -> default level; blosc codecs use byte shuffle with typesize = item size and 1 MiB blocks.
CODECS = {"blosc-zstd": 1, "blosc-lz4": 5, "zstd": 1, "none": 0}
DEFAULT_CODEC = {"zarr": "blosc-zstd", "safetensors": "none", "memory": "none"}


def codec_spec(format: str, codec: str | None, level: int | None = None) -> dict[str, Any]:
    """The manifest record of a codec choice, checked against what the store format can do."""
    name = DEFAULT_CODEC[format] if codec in (None, "default") else codec
    if name not in CODECS:
        raise StorageError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if format != "zarr" and name != "none":
        raise StorageError(f"the {format} backend stores raw bytes; codec must be 'none', not {name!r}")
    spec: dict[str, Any] = {"name": name, "level": CODECS[name] if level is None else int(level)}
    if name.startswith("blosc"):
        spec.update(shuffle="byte", blocksize=BLOSC_BLOCKSIZE)
    return spec


def zarr_compressors(spec: dict[str, Any], itemsize: int) -> list:
    """The zarr bytes-to-bytes codec chain of a codec record, ending in a CRC32C over the stored bytes."""
    name, level = spec["name"], spec["level"]
    if name.startswith("blosc"):
        blosc = BloscCodec(
            cname=name.removeprefix("blosc-"), clevel=level, shuffle="shuffle", typesize=itemsize,
            blocksize=spec["blocksize"],
        )
        return [blosc, Crc32cCodec()]
    if name == "zstd":
        return [ZstdCodec(level=level), Crc32cCodec()]
    return [Crc32cCodec()]
