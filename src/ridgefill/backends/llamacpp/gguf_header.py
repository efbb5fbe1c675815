"""A GGUF file's header as ridgefill reads it before llama.cpp loads the file: its architecture (from the header's
first key-value pairs, no weights and no vocabulary parsed), and the families the fill runs."""

from __future__ import annotations

import struct
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.method.maps_gguf import LLAMACPP_ARCH

FAMILIES = tuple(LLAMACPP_ARCH.values())  # GGUF general.architecture values the patch fills
# GGUF's metadata value types: their struct formats (8: string, 9: array)
GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_architecture(path: str | Path) -> str:
    """A GGUF file's general.architecture, read from its header's key-value pairs up to that key (no weights, and
    not the whole vocabulary, which the `gguf` package's reader parses first: seconds for a 49K-token one)."""
    try:
        with open(path, "rb") as f:
            def take(fmt: str):
                data = f.read(struct.calcsize(fmt))
                if len(data) < struct.calcsize(fmt):
                    raise EOFError("truncated")
                return struct.unpack(fmt, data)[0]

            def text() -> str:
                n = take("<Q")
                if n > 1 << 20:
                    raise ValueError("string too long")
                return f.read(n).decode()

            def skip(kind: int) -> None:
                if kind in GGUF_SCALARS:
                    f.seek(struct.calcsize(GGUF_SCALARS[kind]), 1)
                elif kind == 8:
                    f.seek(take("<Q"), 1)
                elif kind == 9:
                    inner, count = take("<I"), take("<Q")
                    if inner in GGUF_SCALARS:
                        f.seek(count * struct.calcsize(GGUF_SCALARS[inner]), 1)
                    else:
                        for _ in range(count):
                            skip(inner)
                else:
                    raise ValueError(f"value type {kind}")

            if f.read(4) != b"GGUF" or take("<I") not in (2, 3):
                raise ValueError("no GGUF header")
            take("<Q")  # tensors
            for _ in range(take("<Q")):
                key, kind = text(), take("<I")
                if key == "general.architecture" and kind == 8:
                    return text()
                skip(kind)
            raise KeyError("general.architecture")
    except Exception as exc:  # not GGUF, truncated: llama.cpp could not load it either
        raise RidgefillError(f"{path} is not a readable GGUF file ({type(exc).__name__}): point --model at a "
                             ".gguf file or an embedded alias") from None


def check_family(path: str | Path) -> str:
    """The architecture of a GGUF file the fill runs (FAMILIES); anything else (hybrid models among them) is one
    line."""
    arch = gguf_architecture(path)
    if arch not in FAMILIES:
        raise RidgefillError(f"{path} is a {arch} model: --engine llamacpp fills {', '.join(FAMILIES)} models "
                             "(not hybrid or recurrent ones); use --engine torchfill")
    return arch
