"""Shard sizes such as ``"5GB"`` as bytes, in a module without torch so that ``magi2-convert`` checks
``--max_shard_size`` before torch is imported (:mod:`.safetensors_io` re-exports :func:`parse_size`)."""

from __future__ import annotations


__all__ = ["parse_size"]


def parse_size(size: int | str) -> int:
    """Bytes of a shard size such as ``"5GB"`` (decimal, as ``huggingface_hub``), ``"2GiB"`` or ``1234``.

    Raises:
        ValueError: the size is not a positive number of bytes with one of those units.
    """
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip()
        units = {
            "TIB": 1024**4,
            "GIB": 1024**3,
            "MIB": 1024**2,
            "KIB": 1024,
            "TB": 10**12,
            "GB": 10**9,
            "MB": 10**6,
            "KB": 10**3,
            "B": 1,
        }
        upper = text.upper()
        for unit, mult in units.items():
            if upper.endswith(unit):
                number = upper[: -len(unit)].strip()
                break
        else:
            number, mult = upper, 1
        try:
            value = int(float(number) * mult)
        except ValueError:
            raise ValueError(
                f"max_shard_size {size!r} is not a size; use bytes or a number with KB/MB/GB/TB (or KiB/MiB/GiB)"
            ) from None
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value
