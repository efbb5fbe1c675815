"""`ridgefill key-scale`: a closed-form refinement after `fit`: one scalar per late attention layer and KV head
that maps the filled keys' norms onto the exact ones.

A late layer's filled key k_f = RoPE(k-norm(W_k · norm(ŷ))) points roughly the right way but can be too short or
too long: the prediction ŷ misses part of the input, and what it misses changes the key's length. On calibration
text this pass runs every sequence twice, exactly and filled (every row but the first `skip_first` and the last
one filled, as in a long prompt), and for each layer l > S and KV head h sums over the filled rows

    s[l, h] = Σ ‖k_e‖ ‖k_f‖ / Σ ‖k_f‖²,

the least-squares scalar from filled key norms to exact ones (RoPE is a rotation, so the norms are the same
before and after it). Only sums are kept; nothing is trained. The output is the same maps file with a
`key_scale` tensor [L-S, Hkv] (1 for layer S, whose keys are exact, and for non-attention layers), which the
runner applies to every filled key (torchfill/projection.py). It works for identity fill's maps file too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill import __version__
from ridgefill.commands import REQUIRED, Command, option
from ridgefill.torchfill import Runner, FillPlan
from ridgefill.errors import RidgefillError
from ridgefill.method.calibrate import calibration_sequences
from ridgefill.method.maps import filler_of, load_maps, write_maps
from ridgefill.runtime.console import progress_bar, table
from ridgefill.runtime.data import sequence_budget
from ridgefill.runtime.device import check_device
from ridgefill.runtime.paths import check_output, write_json
from ridgefill.runtime.session import ModelConfig


@dataclass
class KeyScaleConfig(ModelConfig):
    maps: Path = option(REQUIRED, "Maps file from `ridgefill fit` (ridge or identity) to add the key scale to.",
                        role="input")
    data: str = option(REQUIRED, "Calibration text (as `calibrate --data`): .txt/.jsonl file or folder, or "
                       "'wiki-leads' / 'shakespeare'.", fallback="data")
    tokens: int = option(16384, "Tokens of calibration text to run (each sequence twice: exact and filled).")
    seq_len: int = option(1024, "Tokens per sequence.")
    skip_first: int = option(1, "Leading rows of each sequence that run in full and are not counted (sinks).")
    out: Path = option(REQUIRED, "Maps file to write (.safetensors, or .gguf: a GGUF adapter, F16): the same maps "
                       "with the key scale; a JSON summary goes beside it.", role="output")

    def check(self) -> None:
        if self.tokens < 1 or self.seq_len < 2:
            raise RidgefillError("--tokens must be >= 1 and --seq-len >= 2")
        if self.skip_first < 0:
            raise RidgefillError(f"--skip-first {self.skip_first} must be 0 or more")
        if self.skip_first >= self.seq_len - 1:
            raise RidgefillError(f"--skip-first {self.skip_first} leaves no row of a {self.seq_len}-token sequence to "
                                 "fill: lower it or raise --seq-len")
        check_output(self, beside=(".json",))


@dataclass
class KeyNormSums:
    """Per layer S..L-1 and KV head, over filled rows: Σ‖k_e‖‖k_f‖, Σ‖k_f‖², Σ‖k_e‖² (float64 [L-S, Hkv], on the
    device the keys are on)."""

    cross: torch.Tensor
    filled: torch.Tensor
    exact: torch.Tensor
    rows: int = 0

    @classmethod
    def empty(cls, layers: int, heads: int, device: str | torch.device = "cpu") -> "KeyNormSums":
        z = lambda: torch.zeros(layers, heads, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z())

    def add(self, index: int, exact: torch.Tensor, filled: torch.Tensor) -> None:
        """exact, filled: keys [B, Hkv, n, D] of the same filled rows of one layer."""
        ne = torch.linalg.vector_norm(exact.double(), dim=-1)  # [B, Hkv, n]
        nf = torch.linalg.vector_norm(filled.double(), dim=-1)
        self.cross[index] += (ne * nf).sum((0, 2))
        self.filled[index] += (nf * nf).sum((0, 2))
        self.exact[index] += (ne * ne).sum((0, 2))

    def scale(self) -> torch.Tensor:
        """[L-S, Hkv] the least-squares scalars (1 where nothing was summed: layer S, non-attention layers)."""
        return torch.where(self.filled > 0, self.cross / self.filled.clamp_min(1e-300), torch.ones_like(self.cross))

    def norm_error(self, scale: torch.Tensor) -> torch.Tensor:
        """[L-S] per layer: Σ(‖k_e‖ − s‖k_f‖)² / Σ‖k_e‖² over heads (NaN where nothing was summed)."""
        sse = self.exact - 2 * scale * self.cross + scale.square() * self.filled
        return sse.sum(1) / self.exact.sum(1)


def key_norm_sums(runner: Runner, plan: FillPlan, ids: torch.Tensor, sums: KeyNormSums) -> None:
    """Prefill `ids` [1, T] exactly and with `plan` (outlier rule off, so every row it fills is filled) and add
    the key norms of the filled rows of every late attention layer to `sums`."""
    exact = runner.prefill(ids, logits_at=[]).cache
    filled = runner.prefill(ids, fill=plan, logits_at=[]).cache
    rows = (~plan.full_rows(ids.shape[1])).to(runner.device)  # [T] bool
    split, kinds = plan.split, runner.layer_kinds
    for layer in range(split + 1, runner.n_layers):
        if kinds[layer] == "attention":
            sums.add(layer - split, exact[layer].keys[:, :, rows], filled[layer].keys[:, :, rows])
    sums.rows += int(rows.sum()) * ids.shape[0]


def run(c: KeyScaleConfig) -> dict:
    """Run the pass, print per layer the scale over heads and the key-norm error before and after, write the
    maps with the key scale and a JSON summary beside them. The maps written are those read at the start, which the
    scale was measured on (their sha256 is recorded as `maps_sha256`)."""
    check_device(c.device, c.dtype)
    session = c.open()
    runner = session.runner
    # Read once, into private memory: the maps measured are the maps written (pinned by their sha256), whatever
    # happens to the file during the pass (a refit).
    tensors, stored, digest = load_maps(c.maps)
    filler, meta = filler_of(c.maps, tensors, {**stored, "sha256": digest}, session.loaded.info(), dtype=runner.dtype,
                             device=runner.device)
    if meta["n_layers"] != runner.n_layers:
        raise RidgefillError(f"{c.maps} holds maps for {meta['n_layers']} layers, the model has {runner.n_layers}: "
                             "fit maps for this model")
    filler.key_scale = None  # the pass measures the maps as fitted, without any earlier correction
    _, _, sequences = calibration_sequences(session, c.data, c.seq_len, c.tokens)
    budget = sequence_budget(c.tokens, c.seq_len)
    plan = FillPlan(filler, tail=1, keep_rows=tuple(range(c.skip_first)))
    split = filler.split
    sums = KeyNormSums.empty(runner.n_layers - split, runner.shape.kv_heads, runner.device)
    done = 0
    with progress_bar(f"key scale, split {split}", budget) as advance:
        for seq in sequences:
            key_norm_sums(runner, plan, torch.tensor([seq], device=runner.device), sums)
            done += 1
            advance()
    scale = sums.scale()  # [L-S, Hkv], on the model's device
    before, after = sums.norm_error(torch.ones_like(scale)).cpu(), sums.norm_error(scale).cpu()
    scale = scale.cpu()
    info = {"data": c.data, "tokens": done * c.seq_len, "sequences": done, "filled_rows": sums.rows,
            "skip_first": c.skip_first, "maps_sha256": digest}
    write_maps(c.out, {**tensors, "key_scale": scale.float()}, {**stored, "key_scale": info},
               fix=f"the maps {c.maps} fill keys the scale cannot reach in fp32: refit them (a larger --lam), then "
                   "rerun key-scale", model=c.model)
    attention = [i for i in range(1, len(scale)) if runner.layer_kinds[split + i] == "attention"]
    rows = [[split + i, float(scale[i].min()), float(scale[i].median()), float(scale[i].max()), float(before[i]),
             float(after[i])] for i in attention]
    table(f"key scale per layer (over {scale.shape[1]} KV heads), {sums.rows} filled rows → {c.out}",
          ["layer", "scale min", "median", "max", "key-norm error before", "after"], rows)
    summary = {"command": "key-scale", "maps": str(c.out), "from": str(c.maps), "split": split, **info,
               "layers": [dict(zip(["layer", "scale_min", "scale_median", "scale_max", "norm_error_before",
                                    "norm_error_after"], r)) for r in rows],
               "scale": scale.tolist(), "ridgefill_version": __version__}
    write_json(Path(str(c.out) + ".json"), summary)
    return summary


COMMAND = Command("key-scale", KeyScaleConfig, run, summary_json=True)
