"""`ridgefill convert-maps`: a maps file rewritten in the other format, safetensors ↔ GGUF adapter
(method/maps_gguf.py), as --out's name says. The maps are the same: read whole once, checked against their own
metadata, written atomically."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ridgefill.commands import REQUIRED, Command, Config, option
from ridgefill.method.maps import check_maps, check_meta, load_maps, write_maps
from ridgefill.method.maps_gguf import GGUF_TYPES, SUFFIX, check_gguf_type, gguf_type_option, is_gguf_path
from ridgefill.runtime.console import note
from ridgefill.runtime.paths import check_output


@dataclass
class ConvertMapsConfig(Config):
    maps: Path = option(REQUIRED, "Maps file to convert (.safetensors or .gguf, from ridgefill fit).", role="input")
    out: Path = option(REQUIRED, f"Maps file to write: {SUFFIX} (the maps as a llama.cpp adapter) or .safetensors.",
                       role="output")
    gguf_type: str | None = gguf_type_option()
    model: str | None = option(None, "Where the maps' model is, when it is not at the id they were fitted as (a "
                               f"{SUFFIX} adapter records its architecture, width and KV heads; its weights must be "
                               "the maps').")

    def check(self) -> None:
        check_gguf_type(self.out, self.gguf_type)
        check_output(self)


def run(c: ConvertMapsConfig) -> dict:
    """Read the maps, check them against their metadata, write them as --out's name says; one line on stderr."""
    tensors, meta, digest = load_maps(c.maps)
    check_meta(c.maps, meta)
    check_maps(c.maps, tensors, meta)
    source = {"path": str(c.maps), "sha256": digest}
    write_maps(c.out, tensors, {**meta, "converted_from": source}, c.gguf_type, model=c.model)
    to_gguf = is_gguf_path(c.out)
    written = f"a GGUF adapter, matrices {c.gguf_type or GGUF_TYPES[0]}" if to_gguf else "safetensors, fp32"
    note(f"{c.maps} → {c.out} ({written}; {meta['kind']} maps, split {meta['split']} of {meta['n_layers']} layers)")
    return {"command": "convert-maps", "maps": str(c.out), "from": source, "format": "gguf" if to_gguf else
            "safetensors", "gguf_type": (c.gguf_type or GGUF_TYPES[0]) if to_gguf else None, "kind": meta["kind"],
            "split": meta["split"], "n_layers": meta["n_layers"]}


COMMAND = Command("convert-maps", ConvertMapsConfig, run)
