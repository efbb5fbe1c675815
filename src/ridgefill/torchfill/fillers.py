"""Fillers: what a filled row gets as the input of each late layer, predicted from the split state.

A filler for split S maps the split state x (the residual stream entering layer S) of the filled rows to
predicted inputs of layers S+1..L-1. Layer S itself always gets x (its map is the identity, so its cache
is exact). `predict` returns [B, n, L-S-1, H]; `late_inputs` returns the same inputs layer-major with x first,
[L-S, B·n, H], the layout of the fused fill projection (torchfill/projection.py), each filler computing it its own
way (no copy for identity fill, one batched GEMM for maps). A filler may carry a key-scale correction
(`key_scale` [L-S, Hkv]: each late attention layer's filled keys are multiplied per KV head; 1 where none is
fitted; method/key_scale.py fits it). Two null controls are fillers too: `MeanFiller` gives every filled row the
calibration mean of each late layer's input (a map whose weights are zero: it ignores the row), and `DropFiller`
(`drops`) gives it nothing: filled rows write no cache in layers S..L-1 and the full rows there attend only to full
rows. Maps with lookback K (torchfill/lookback.py) also read the split states of the
K rows before each filled row: `previous` [B, n, K·H], nearest first; the runner gives it, and runs in full every
filled row whose window it cannot give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch


class Filler(Protocol):
    split: int
    n_layers: int
    key_scale: torch.Tensor | None  # [L-S, Hkv] per layer S..L-1 and KV head; None: no correction
    lookback: int  # K: rows before each filled row whose split states the maps read (0: none)
    lookback_start: int  # the first position a lookback window may hold (calibration's --skip-first)
    drops: bool  # True: filled rows write no cache in layers S..L-1 (DropFiller); late_inputs is never asked

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, n, H] split state of the filled rows at absolute `positions` [n] (previous [B, n, K·H]: their
        windows' split states, with lookback K > 0) -> [B, n, L-S-1, H]."""
        ...

    def late_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, n, H] -> [L-S, B·n, H]: the input of each late layer S..L-1, layer-major (index 0: x itself)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the filler's tensors."""
        ...

    @property
    def rank(self) -> int | None:
        """The rank of low-rank maps; None for full-rank maps, identity and oracle fill."""
        ...

    def flops_per_row(self) -> int:
        """FLOPs (multiply-adds × 2) of one filled row's maps, layers S+1..L-1."""
        ...


def maps_flops(hidden: int, maps: int, rank: int | None = None, lookback: int = 0) -> int:
    """FLOPs (multiply-adds × 2) of one filled row through `maps` affine maps from (K+1)·H inputs (lookback K) to H
    outputs: f·W at full rank, f·U then z·V at rank r."""
    f = hidden * (lookback + 1)
    return maps * (2 * f * hidden if rank is None else 2 * rank * (f + hidden))


def late_inputs_by_layer(filler: Filler, x: torch.Tensor, positions: torch.Tensor,
                         previous: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Each late layer's input [B·n, H], in layer order S..L-1 (x first), one at a time: a MapFiller computes each
    when asked (MapFiller.layer_inputs); any other filler yields the rows of its late_inputs."""
    if isinstance(filler, MapFiller):
        return filler.layer_inputs(x, positions, previous)
    return iter(filler.late_inputs(x, positions, previous))


def _n_maps(filler) -> int:
    """Predicted layers S+1..L-1."""
    return filler.n_layers - filler.split - 1


def _with_split_state(x: torch.Tensor, maps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as rows [B·n, H], an uninitialised [maps+1, B·n, H] whose index 0 already holds them)."""
    b, n, h = x.shape
    flat = x.reshape(b * n, h)
    out = flat.new_empty(maps + 1, b * n, h)
    out[0] = flat
    return flat, out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Affine:
    """A filler's late-layer inputs as plain affine maps, for an engine that applies them itself (llama.cpp): for
    each predicted layer S+1+j, input = f·W_j + b_j. weights [L-S-1, F, H]; or, at low rank, low_rank = (U
    [L-S-1, F, r], V [L-S-1, r, H]) with W_j = E + U_j V_j (E: the identity on x's block); biases [L-S-1, H]. No
    weights and no low_rank: W_j = I (identity fill) when biases is None, else W_j = 0 (the mean control)."""

    weights: torch.Tensor | None = None
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None
    biases: torch.Tensor | None = None


class IdentityFiller:
    """Identity fill (training-free, SwiftKV-style): x itself is every late layer's input."""

    name = "identity"
    nbytes = 0
    rank = None
    lookback = lookback_start = 0
    drops = False

    def __init__(self, split: int, n_layers: int, key_scale: torch.Tensor | None = None) -> None:
        self.split, self.n_layers, self.key_scale = split, n_layers, key_scale

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        return x.unsqueeze(2).expand(-1, -1, _n_maps(self), -1)

    def late_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
        b, n, h = x.shape
        return x.reshape(b * n, h).expand(_n_maps(self) + 1, b * n, h)  # a stride-0 view: no copy

    def flops_per_row(self) -> int:
        return 0

    def affine(self) -> Affine:
        return Affine()


class DropFiller:
    """The `drop` control: filled rows bring nothing to layers S..L-1 (no K/V, no recurrent-state update); the full
    rows there attend only to full rows (the kept first rows, the tail, decode). The cheapest fill there is."""

    name = "drop"
    nbytes = 0
    rank = None
    key_scale = None
    lookback = lookback_start = 0
    drops = True

    def __init__(self, split: int, n_layers: int) -> None:
        self.split, self.n_layers = split, n_layers

    def flops_per_row(self) -> int:
        return 0

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError("drop fill predicts no late-layer input: its filled rows write no cache in layers S..L-1")

    late_inputs = predict


class MeanFiller:
    """The `mean` control: every filled row's input of late layer l = S+1..L-1 is the calibration mean of that
    layer's input (means [L-S-1, H]; a map with zero weights, its bias the mean). Layer S gets x itself, as in
    every fill (its cache is exact)."""

    name = "mean"
    rank = None
    lookback = lookback_start = 0
    drops = False

    def __init__(self, split: int, n_layers: int, means: torch.Tensor, key_scale: torch.Tensor | None = None) -> None:
        self.split, self.n_layers, self.key_scale = split, n_layers, key_scale
        self._means = means  # [L-S-1, H]

    def to(self, device: torch.device, dtype: torch.dtype) -> "MeanFiller":
        self._means = self._means.to(device=device, dtype=dtype)
        if self.key_scale is not None:
            self.key_scale = self.key_scale.to(device=device, dtype=dtype)
        return self

    @property
    def nbytes(self) -> int:
        return _nbytes([self._means] + ([self.key_scale] if self.key_scale is not None else []))

    def flops_per_row(self) -> int:
        return 0  # no map is applied: the inputs are constants

    def affine(self) -> Affine:
        return Affine(biases=self._means)

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        return self._means.expand(b, n, *self._means.shape)

    def late_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
        flat, out = _with_split_state(x, _n_maps(self))  # out [m+1, R, H]
        out[1:] = self._means.unsqueeze(1)
        return out


class MapFiller:
    """Fitted affine maps f·W_l + b_l for l = S+1..L-1, applied as one GEMM against their concatenation.

    f is the filled row's split state x [H], or with lookback K its window's too: [x_t, x_{t-1}, .., x_{t-K}]
    [F = (K+1)·H]. weights: [L-S-1, F, H]; biases: [L-S-1, H]. A low-rank map stores W_l = E + U_l V_l (E: the
    identity on x's block, zero on the window's); then `low_rank` = (U [L-S-1, F, r], V [L-S-1, r, H]) and
    `weights` is None. lookback_start: the first position a window may hold (torchfill/lookback.py).
    """

    name = "ridge"
    drops = False

    def __init__(self, split: int, n_layers: int, weights: torch.Tensor | None, biases: torch.Tensor,
                 low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
                 key_scale: torch.Tensor | None = None, lookback_start: int = 0) -> None:
        self.split, self.n_layers, self.key_scale = split, n_layers, key_scale
        hidden = biases.shape[-1]
        self._biases = biases  # [L-S-1, H]
        self._stacked = self._stacked_u = self._v = None
        if weights is not None:
            features = weights.shape[1]
            # [F, (L-S-1)*H]: column block j is layer S+1+j's map.
            self._stacked = weights.permute(1, 0, 2).reshape(features, _n_maps(self) * hidden).contiguous()
        else:
            u, v = low_rank
            features = u.shape[1]
            self._stacked_u = u.permute(1, 0, 2).reshape(features, -1).contiguous()  # [F, (L-S-1)*r]
            self._v = v  # [L-S-1, r, H]
        if features % hidden:
            raise ValueError(f"map inputs of width {features} are not a whole number of {hidden}-wide split states")
        self.lookback = features // hidden - 1
        self.lookback_start = lookback_start
        self._gemms = None  # use_gemm: one prepared GEMM per full-rank map, f [R, F] -> f·W_l + b_l [R, H]

    def use_gemm(self, make) -> None:
        """Apply full-rank maps one per layer through `make(weight [H, F], bias [H])`, a callable x [R, F] ->
        x·weightᵀ + bias (e.g. a serving engine's prepacked GEMM), when `layer_inputs` asks for each; low-rank maps
        keep their two products."""
        if self._stacked is not None and _n_maps(self):
            h = self._biases.shape[-1]
            self._gemms = [make(self._stacked[:, j * h:(j + 1) * h].t().contiguous(), self._biases[j].contiguous())
                           for j in range(_n_maps(self))]

    def layer_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                     previous: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """late_inputs one layer at a time, x first: with use_gemm's per-layer GEMMs each [B·n, H] is computed only
        when the next is asked for, so nothing of size [L-S, B·n, H] is allocated (a serving engine's filled step
        writes each layer's K/V from it and drops it); otherwise the rows of late_inputs."""
        if self._gemms is None:
            yield from self.late_inputs(x, positions, previous)
            return
        b, n, h = x.shape
        yield x.reshape(b * n, h)
        f = self._inputs(x, previous)  # [B·n, F]
        for gemm in self._gemms:
            yield gemm(f)

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("_stacked", "_stacked_u", "_v", "_biases", "key_scale")  # _gemms' prepared weights are their own
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to(self, device: torch.device, dtype: torch.dtype) -> "MapFiller":
        for name, tensor in self._tensors().items():
            setattr(self, name, tensor.to(device=device, dtype=dtype))
        return self

    @property
    def nbytes(self) -> int:
        return _nbytes(self._tensors().values())

    @property
    def rank(self) -> int | None:
        return None if self._v is None else self._v.shape[1]

    def flops_per_row(self) -> int:
        return maps_flops(self._biases.shape[-1], _n_maps(self), self.rank, self.lookback)

    def affine(self) -> Affine:
        m, h = _n_maps(self), self._biases.shape[-1]
        if self._stacked is not None:  # [F, m·H] -> [m, F, H]
            return Affine(weights=self._stacked.view(-1, m, h).transpose(0, 1), biases=self._biases)
        u = self._stacked_u.view(-1, m, self._v.shape[1]).transpose(0, 1)  # [F, m·r] -> [m, F, r]
        return Affine(low_rank=(u, self._v), biases=self._biases)

    def _inputs(self, x: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """x [B, n, H], previous [B, n, K·H] -> the maps' inputs [B·n, F]."""
        b, n, h = x.shape
        if not self.lookback:
            return x.reshape(b * n, h)
        if previous is None or previous.shape[-1] != self.lookback * h:
            raise ValueError(f"maps with lookback {self.lookback} need the split states of the {self.lookback} rows "
                             "before each filled row")
        return torch.cat([x, previous], dim=-1).reshape(b * n, -1)

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        b, n, h = x.shape
        m = _n_maps(self)
        f = self._inputs(x, previous)  # [B*n, F]
        if self._v is None:
            out = (f @ self._stacked).view(b, n, m, h)
        else:
            r = self._v.shape[1]
            z = (f @ self._stacked_u).view(b * n, m, r).transpose(0, 1)  # [maps, B*n, r]
            out = x.unsqueeze(2) + torch.bmm(z, self._v).transpose(0, 1).view(b, n, m, h)
        return out + self._biases

    def late_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
        m = _n_maps(self)
        flat, out = _with_split_state(x, m)  # flat [R, H], out [m+1, R, H]
        if m == 0:
            return out
        h = flat.shape[1]
        f = self._inputs(x, previous)  # [R, F]
        if self._gemms is not None:
            for j, gemm in enumerate(self._gemms):
                out[1 + j] = gemm(f)
            return out
        if self._v is None:
            weights = self._stacked.view(f.shape[1], m, h).transpose(0, 1)  # [m, F, H], a view: block j is map j
            torch.bmm(f.expand(m, -1, -1), weights, out=out[1:])
        else:  # W = E + U V: x + (f U) V + b
            z = (f @ self._stacked_u).view(flat.shape[0], m, -1).transpose(0, 1)  # [m, R, r]
            torch.bmm(z, self._v, out=out[1:])
            out[1:] += flat
        out[1:] += self._biases.unsqueeze(1)
        return out


class OracleFiller:
    """The true late-layer inputs of an exact run, indexed by position (for exactness tests and splices).

    hidden: [B, N, L+1, H] or a list of L+1 tensors [B, N, H] (index l = input of layer l).
    """

    name = "oracle"
    rank = None
    key_scale = None
    lookback = lookback_start = 0
    drops = False

    def __init__(self, split: int, hidden: list[torch.Tensor]) -> None:
        self.split = split
        self.n_layers = len(hidden) - 1
        late = list(hidden[split + 1 : self.n_layers])
        b, n, h = hidden[0].shape
        self.late = torch.stack(late, dim=2) if late else hidden[0].new_empty(b, n, 0, h)  # [B, N, L-S-1, H]

    @property
    def nbytes(self) -> int:
        return _nbytes([self.late])

    def flops_per_row(self) -> int:
        return 0  # a lookup, no maps

    def predict(self, x: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        return self.late[:, positions]

    def late_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
        m = _n_maps(self)
        flat, out = _with_split_state(x, m)
        if m:
            out[1:] = self.predict(x, positions).reshape(flat.shape[0], m, -1).transpose(0, 1)  # [m, R, H]
        return out
