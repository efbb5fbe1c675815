"""What a maps file's GGUF form costs in agreement (docs/llamacpp.md, "Maps as a GGUF adapter"): the same maps as
safetensors (the reference) and in other files (an F32 and an F16 .gguf from `ridgefill convert-maps`), with two
controls written here (the reference's weights times 1 + u, u uniform in ±2^-12 and ±2^-20), on evaluation passages:

- the late inputs: each file's filler on layer S's inputs (torchfill on the model's conversion, every row but each
  passage's first): max abs difference to the reference's, and the largest relative difference per row;
- `--engine llamacpp`'s last-row logits after the filled prefill, and its greedy tokens: max abs difference of the
  logits, and the prompts whose tokens equal the reference's (where the others part).

    python scripts/gguf_maps_check.py --maps maps-s18.safetensors maps-s18-f32.gguf maps-s18.gguf
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from ridgefill.commands import command
from ridgefill.evals.passages import evaluation_passages
from ridgefill.method.fill import FillSettings
from ridgefill.method.maps import load_filler, load_maps, write_maps
from ridgefill.runtime.session import open_session


def controls(reference: Path, folder: Path, seed: int = 0) -> dict[str, Path]:
    """The reference maps with their matrices times 1 + u, u uniform in ±2^-e, in float32 (safetensors)."""
    tensors, meta, _ = load_maps(reference)
    out, g = {}, torch.Generator().manual_seed(seed)
    for e in (12, 20):
        changed = {k: t * (1 + 2.0 ** -e * (2 * torch.rand(t.shape, generator=g) - 1)) if k in ("weight", "u", "v")
                   else t for k, t in tensors.items()}
        out[f"control ±2^-{e}"] = folder / f"control-{e}.safetensors"
        write_maps(out[f"control ±2^-{e}"], changed, meta)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maps", nargs="+", type=Path, required=True, help="the reference maps first, then the others")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--data", default="shakespeare")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        files = {str(p): p for p in a.maps} | controls(a.maps[0], Path(folder))
        run(a, files)


def run(a, files: dict[str, Path]) -> None:
    names = list(files)
    generate = command("generate").make(engine="llamacpp", model=a.model, maps=files[names[0]], prompt="-",
                                        tail=a.tail)
    generate.check()
    backend = generate.open_backend()
    model = backend.model
    prompts = evaluation_passages(model.tokenizer, a.data, a.length, a.prompts)
    fillers = {k: load_filler(p, model.model_info)[0] for k, p in files.items()}
    session, xs = open_session(a.model, "fp32", "cpu"), []
    split = fillers[names[0]].split

    def observe(layer, h, positions):
        if layer == split:
            xs.append(h[0, 1:].clone())

    for ids in prompts:
        session.runner.prefill(torch.tensor([ids]), observe=observe)
    x = torch.cat(xs)
    late = {k: f.predict(x[None], torch.arange(len(x)))[0] for k, f in fillers.items()}
    fills = {k: FillSettings("ridge", maps=p, tail=a.tail) for k, p in files.items()}
    plans = {k: f.plan(model)[0] for k, f in fills.items()}
    logits, tokens = {k: [] for k in files}, {k: [] for k in files}
    eos = model.tokenizer.eos_token_id
    with backend.use(fills, plans).start(a.length + a.new_tokens):
        for ids in prompts:
            for k in files:
                logits[k].append(backend._prefill(k, ids, [len(ids) - 1]).logits[-1].clone())
                tokens[k].append(backend.generate(k, ids, a.new_tokens, eos).tokens)
    ref = names[0]
    print(f"{len(prompts)} passages of {a.length} tokens, split {split}, tail {a.tail}; late inputs up to "
          f"{late[ref].abs().max():.3g} (rms {late[ref].pow(2).mean().sqrt():.3g}), {len(x)} rows")
    for k in names[1:]:
        e = late[k] - late[ref]
        diffs = sorted((p - q).abs().max().item() for p, q in zip(logits[k], logits[ref]))
        parts = [next((i for i, (p, q) in enumerate(zip(s, t)) if p != q), None)
                 for s, t in zip(tokens[k], tokens[ref])]
        print(f"{k}: late inputs max abs {e.abs().max():.3g} (largest relative per row "
              f"{(e.norm(dim=-1) / late[ref].norm(dim=-1)).max():.3g}); last-row logits max abs median "
              f"{diffs[len(diffs) // 2]:.3g} (max {diffs[-1]:.3g}); greedy: {parts.count(None)} of {len(prompts)} "
              f"the same {a.new_tokens} tokens (parting at {[p for p in parts if p is not None]})")


if __name__ == "__main__":
    main()
