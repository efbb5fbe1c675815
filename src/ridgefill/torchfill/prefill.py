"""Exact prefill, filled prefill and decode steps: the one API every command uses.

Semantics (split S, L layers, tail T, keep_first F, keep_rows K):
- layers 0..S-1 run exactly on every prompt row; the split state x is the residual stream entering layer S;
- a row is *full* if it is one of the last T rows, one of the first F (all of them when F reaches past the
  prompt) or in K;
- a filled row writes the cache of each late layer l = S..L-1 from a predicted input (layer S: x itself;
  l > S: the filler's prediction) through that layer's own input norm, K/V projections, k-norm and RoPE
  at its true position; it runs no attention or MLP in those layers (a chunk's filled rows get their K/V
  for every late attention layer from one fused projection, torchfill/projection.py);
- full rows run every layer, attending to all cached keys at or before their position (filled or not).
- drop fill (the null control, torchfill/fillers.py DropFiller): filled rows write nothing in layers S..L-1 (no K/V,
  no recurrent-state update), so there the full rows attend only to full rows.
- a filled window (FillPlan.window, torchfill/window.py): in its layers below the split, filled rows attend only to
  the sinks and the W rows before them; full rows attend to everything.

Rows are processed chunk by chunk in position order, so activation memory stays bounded and a chunk's
full rows see the cache written by every earlier row. With T >= prompt length, or S = L, every row is
full and the result is the exact model's.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ridgefill.clock import clocked
from ridgefill.torchfill.families.base import Adapter
from ridgefill.torchfill.cache import AttentionCache, Cache
from ridgefill.torchfill.chunk_rows import ChunkRows
from ridgefill.torchfill.fill_plan import FillPlan, Promoted
from ridgefill.torchfill.fillers import Filler
from ridgefill.torchfill.lookback import lookback_windows, window_states
from ridgefill.torchfill.projection import FillProjection
from ridgefill.torchfill.routes import Routes
from ridgefill.torchfill.shape import ModelShape
from ridgefill.torchfill.timing import Stopwatch
from ridgefill.torchfill.window import FilledWindow
from ridgefill.defaults import DEFAULT_CHUNK
from ridgefill.errors import RidgefillError

# observe(layer, h, positions): h [B, n, H] the input of `layer` (layer = L: the final residual stream)
# for the rows at absolute `positions` [n] that run that layer.
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]



@dataclass
class PrefillResult:
    cache: Cache
    logits: torch.Tensor  # [B, m, V] at `rows`
    rows: torch.Tensor  # [m] prompt-relative row indices that have logits
    n_rows: int
    n_filled: int  # rows filled (rows that ran in full instead not counted)
    n_outliers: int = 0  # rows that would have been filled but ran in full (FillPlan.outlier_factor)
    n_unwindowed: int = 0  # ... ran in full: their lookback window was not whole (torchfill/lookback.py)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # [B][k] generated token ids
    ttft_s: float  # prompt ids -> first generated token
    total_s: float
    prefill: PrefillResult = field(repr=False, default=None)


class Runner:
    """Runs a model's exact and filled prefill and its decode steps, through the model's adapter (torchfill, the
    engine `--engine torchfill` names, is this class behind backends/torchfill.py). `chunk` bounds how many prompt
    rows run at once; `projection` is the filled rows' K/V projection backend (torchfill/projection.py: auto, torch,
    layers); `timer` (a Stopwatch) gets the wall time of that projection added to it (None: not timed). `routes`
    (torchfill/routes.py): the route each piece takes on this device, chosen once here (RIDGEFILL_ROUTES overrides
    some)."""

    def __init__(self, adapter: Adapter, chunk: int = DEFAULT_CHUNK, projection: str = "auto",
                 timer: Stopwatch | None = None) -> None:
        self.adapter = adapter
        self.chunk = chunk
        self.routes = Routes.for_model(adapter.device, adapter.dtype, adapter.n_heads, adapter.n_kv_heads,
                                       adapter.head_dim, projection)
        adapter.use_routes(self.routes)
        self.projection = FillProjection(adapter, self.routes.projection, timer)  # the filled rows' fused K/V

    def with_timer(self, timer: Stopwatch | None) -> "Runner":
        """A runner over the same model, chunk and projection backend (sharing the stacked K/V weights already
        built) whose fill projection adds its wall time to `timer`."""
        other = copy.copy(self)
        other.projection = self.projection.with_timer(timer)
        return other

    # --- what the model is ----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.adapter.n_layers

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer: "attention" or the family's other kind (hybrid linear-attention layers)."""
        return [self.adapter.layer_kind(layer) for layer in range(self.n_layers)]

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.adapter)

    @property
    def context_length(self) -> int | None:
        """The model's context (max positions), None if it declares none."""
        return self.adapter.max_positions

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    def fused_kv_bytes(self, split: int) -> int:
        """Bytes of the stacked K/V weights the fused projection keeps for `split` (0: no fused path)."""
        stack = self.projection.stack(split)
        return stack.nbytes if stack is not None else 0

    def projection_backend(self, split: int) -> str:
        """The route a filled row's late K/V take at `split`: "torch" (fused) or "layers"."""
        return self.projection.backend_for(split)

    def new_cache(self) -> Cache:
        return Cache([self._layer_cache(layer) for layer in range(self.n_layers)])

    def _layer_cache(self, layer: int):
        if self.adapter.layer_kind(layer) == "attention":
            return AttentionCache()
        return self.adapter.new_state_cache(layer)

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        fill: FillPlan | None = None,
        cache: Cache | None = None,
        logits_at: str | Sequence[int] = "last",
        chunk: int | None = None,
        observe: Observer | None = None,
        capacity: int = 0,
        window: FilledWindow | None = None,
    ) -> PrefillResult:
        """Run prompt rows `ids` [B, N] after whatever `cache` holds (exact if `fill` is None).

        logits_at: "last", "full" (every full row) or prompt-relative row indices (all must be full rows).
        capacity: cache positions to preallocate (e.g. prompt + tokens to generate).
        window: without `fill` (calibration's forward), every row at or past the window's sinks attends locally in
        the window's layers, as a filled row of a plan with that window would (with `fill`: fill.window).
        """
        ids = ids.to(self.adapter.device)
        n_rows = ids.shape[1]
        cache = cache if cache is not None else self.new_cache()
        start = cache.length
        self._check_length(start + n_rows)
        if fill is not None and not 1 <= fill.split <= self.n_layers:
            raise RidgefillError(f"split {fill.split} is out of range: use 1..{self.n_layers} for this model")
        if fill is not None and fill.split < self.n_layers:
            full = fill.full_rows(n_rows)
        else:  # exact, or S = L: no layer is left to fill
            full = torch.ones(n_rows, dtype=torch.bool)
        wanted = self._logit_rows(logits_at, full)
        window, windowed = self._windowed_rows(fill, window, full, start)
        chunk = chunk or self.chunk
        capacity = max(capacity, start + n_rows)
        hidden, rows, promoted = [], [], Promoted()
        for c0 in range(0, n_rows, chunk):
            c1 = min(n_rows, c0 + chunk)
            sel = wanted[(wanted >= c0) & (wanted < c1)]
            h_full, full_idx, ran_full = self._chunk(ids[:, c0:c1], start + c0, full[c0:c1], fill, cache, observe,
                                                     capacity, window, windowed[c0:c1])
            promoted += ran_full
            if len(sel):
                where = torch.searchsorted(full_idx, sel - c0)
                hidden.append(h_full[:, where])
                rows.append(sel)
        if hidden:
            logits = self.adapter.logits(torch.cat(hidden, dim=1))
        else:
            logits = torch.empty(ids.shape[0], 0, 0)
        rows_t = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        n_filled = int((~full).sum()) - promoted.total
        if fill is not None:
            fill.tally.filled_tokens += n_filled
            fill.tally.outlier_tokens += promoted.outliers
            fill.tally.lookback_full_tokens += promoted.unwindowed
        return PrefillResult(cache, logits, rows_t, n_rows, n_filled, promoted.outliers, promoted.unwindowed)

    @torch.inference_mode()
    def decode_step(self, cache: Cache, tokens: torch.Tensor) -> torch.Tensor:
        """Run the full model on `tokens` [B, 1] after `cache`; returns logits [B, V]."""
        return self.prefill(tokens.view(-1, 1), cache=cache).logits[:, -1]

    @torch.inference_mode()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        fill: FillPlan | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> GenerationResult:
        """Greedy generation after an exact or filled prefill; every decode step runs the full model. Time to first
        token is read from the one clock (ridgefill/clock.py: the device synchronised before each read)."""
        t0 = time.perf_counter()

        def first() -> tuple[PrefillResult, torch.Tensor]:
            pre = self.prefill(ids, fill=fill, capacity=ids.shape[1] + max_new_tokens)
            return pre, pre.logits[:, -1].argmax(-1)  # [B]

        ttft, (pre, token) = clocked(first, self.device)
        tokens = self.decode_greedy(pre.cache, token, max_new_tokens, eos_token_id)
        return GenerationResult(tokens, ttft, time.perf_counter() - t0, pre)

    @torch.inference_mode()
    def decode_greedy(
        self,
        cache: Cache,
        first_token: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> list[list[int]]:
        """Greedy decoding after `cache` from each row's first generated token `first_token` [B] (it counts
        among the `max_new_tokens`; at least it is returned). A row ends at its first end-of-sequence token
        (kept) or when `stop(row_tokens)`, asked after each of its tokens, says so; decoding ends when every
        row has ended or after `max_new_tokens`. Every step runs the full model. Returns [B][k] token ids."""
        eos = _token_set(eos_token_id)
        token = first_token.reshape(-1)  # [B]
        rows: list[list[int]] = [[t] for t in token.tolist()]
        done = [_ended(row, eos, stop) for row in rows]
        for _ in range(max_new_tokens - 1):
            if all(done):
                break
            token = self.decode_step(cache, token.view(-1, 1)).argmax(-1)  # [B]
            for row, t, ended in zip(rows, token.tolist(), done):
                if not ended:
                    row.append(t)
            done = [ended or _ended(row, eos, stop) for row, ended in zip(rows, done)]
        return rows

    # ------------------------------------------------------------------------------------------
    def _check_length(self, total: int) -> None:
        limit = self.context_length
        if limit and total > limit:
            raise RidgefillError(
                f"{total} tokens exceed the model's context of {limit}: shorten the prompt or lower the length"
            )

    @staticmethod
    def _logit_rows(logits_at, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[0]
        if logits_at == "last":
            return torch.tensor([n - 1])
        if logits_at == "full":
            return full.nonzero().squeeze(1)
        rows = torch.as_tensor(list(logits_at), dtype=torch.long).sort().values
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise RidgefillError(f"logits requested for rows outside the prompt (0..{n - 1})")
        if not full[rows].all():
            raise RidgefillError("logits requested for filled rows: only full rows (tail or keep_rows) have logits")
        return rows

    def _windowed_rows(self, fill, window, full, start) -> tuple[FilledWindow | None, torch.Tensor]:
        """(the window that applies, [N] bool: the prompt rows that attend locally below the split)."""
        n_rows = full.shape[0]
        if fill is not None:
            window = fill.window if fill.split < self.n_layers else None
            return window, (~full if window is not None else torch.zeros(n_rows, dtype=torch.bool))
        if window is None:
            return None, torch.zeros(n_rows, dtype=torch.bool)
        return window, torch.arange(start, start + n_rows) >= window.sinks

    def _chunk(self, ids, start, full, fill, cache, observe, capacity, window=None, windowed=None):
        """One chunk of rows at absolute positions start..start+n (windowed [n]: the rows that attend locally in
        `window`'s layers below the split). Returns (final hidden of the full rows [B, nU, H], their chunk-relative
        indices [nU], the filled rows that ran in full: `Promoted`)."""
        a = self.adapter
        b, n = ids.shape
        positions = torch.arange(start, start + n, device=ids.device)
        h = a.embed(ids)  # [B, n, H]
        cos, sin = a.rope(positions.unsqueeze(0).expand(b, n), h)  # [B, n, Dr]
        split = fill.split if fill is not None else self.n_layers
        idx_full = full.nonzero().squeeze(1).to(ids.device)
        idx_fill = (~full).nonzero().squeeze(1).to(ids.device)
        rows = ChunkRows(n, idx_full, idx_fill, positions, cos, sin, self.routes)
        local = range(0)  # the layers whose windowed rows attend locally
        if window is not None and bool(windowed.any()):
            local = window.layers(split)
            rows.windowed(windowed, start, window, h.dtype)
        if len(idx_fill) == 0:
            split = self.n_layers  # nothing to fill in this chunk: every layer runs exactly
        filled = None  # FilledRows: what the filled rows bring to each late layer
        promoted = Promoted()
        for layer in range(self.n_layers):
            if layer == split:
                outlier = fill.outlier_rows(h[:, idx_fill])  # [nF] bool
                windows, unwindowed = _windows(fill.filler, positions, idx_fill, outlier)
                run_full = outlier | unwindowed
                if run_full.any():  # they run every layer, like the tail
                    promoted = Promoted(int(outlier.sum()), int((unwindowed & ~outlier).sum()))
                    idx_full = torch.cat([idx_full, idx_fill[run_full]]).sort().values
                    idx_fill, windows = idx_fill[~run_full], windows[~run_full]
                    rows = ChunkRows(n, idx_full, idx_fill, positions, cos, sin, self.routes)
                if len(idx_fill) == 0:
                    split = self.n_layers  # every filled row ran in full: the rest of the chunk runs exactly
            if layer == split:
                if not fill.filler.drops:  # drop fill: the filled rows bring nothing to the late layers
                    previous = window_states(h, windows) if fill.filler.lookback else None  # [B, nF, K·H]
                    filled = self.projection.fill(fill.filler, h[:, idx_fill], positions[idx_fill], rows.cos_fill,
                                                  rows.sin_fill, previous)
                h = h[:, idx_full]
                rows = rows.after_split(fill.filler.drops)
            if observe is not None:
                observe(layer, h, rows.positions_full)
            fill_in = filled.layer(layer) if layer >= split and filled is not None else None
            h = self._layer(layer, h, fill_in, rows, cache, capacity, layer in local)
        if observe is not None:
            observe(self.n_layers, h, rows.positions_full)
        return h, idx_full.cpu(), promoted

    def _layer(self, layer, h, fill_in, rows, cache, capacity, local=False):
        """One decoder layer. h holds the rows that run it ([B, n, H] before the split, [B, nU, H] after);
        fill_in (None before the split): the filled rows' (k, v) [B, Hkv, nF, D] in an attention layer, their
        predicted input [B, nF, H] in any other; local: the windowed rows attend locally (a windowed layer)."""
        if self.adapter.layer_kind(layer) == "attention":
            return self._attention_layer(layer, h, fill_in, rows, cache[layer], capacity, local)
        return self._state_layer(layer, h, fill_in, rows, cache[layer])

    def _attention_layer(self, layer, h, fill_in, rows, layer_cache: AttentionCache, capacity, local=False):
        a = self.adapter
        h_normed = a.input_norm(layer, h)
        k, v = a.key_value(layer, h_normed, rows.cos_run, rows.sin_run)  # [B, Hkv, n_run, D]
        if fill_in is not None:
            k_fill, v_fill = fill_in
            k, v = rows.merge(k, k_fill, dim=2), rows.merge(v, v_fill, dim=2)
        layer_cache.append(k, v, capacity)
        if h.shape[1] == 0:
            return h
        q, gate = a.query(layer, h_normed, rows.cos_run, rows.sin_run)  # q [B, Hq, n_run, D]
        if local:
            attn = rows.attend_locally(q, layer_cache.keys, layer_cache.values, a.attention_scale)
        else:
            attn = rows.attend(q, layer_cache.keys, layer_cache.values, a.attention_scale)
        h = h + a.attention_output(layer, attn, gate)
        return a.mlp_block(layer, h)

    def _state_layer(self, layer, h, fill_in, rows, layer_cache):
        """A recurrent (linear-attention) layer: the state must pass through every row in order, so the
        layer runs its mixer over all chunk rows (predicted inputs for filled rows) and keeps the outputs
        of the full rows."""
        a = self.adapter
        if fill_in is None and h.shape[1] == 0:
            return h  # drop fill, a chunk without full rows: no row passes the state
        x = h if fill_in is None else rows.merge(h, fill_in, dim=1)  # [B, n, H] all chunk rows, in order
        out = a.state_mixer(layer, a.input_norm(layer, x), layer_cache)  # [B, n, H]
        if fill_in is not None:
            out = out[:, rows.idx_full]
        if h.shape[1] == 0:
            return h
        return a.mlp_block(layer, h + out)


def _windows(filler: Filler, positions: torch.Tensor, idx_fill: torch.Tensor,
             outlier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookback windows of a chunk's filled rows `idx_fill` [nF] (chunk-relative; `outlier` [nF] those that run
    in full as outliers, which no window may hold): (index [nF, K] into the chunk's rows, not whole [nF] bool).
    Maps without lookback (K = 0): an empty index and every window whole."""
    blocked = torch.zeros(positions.shape[0], dtype=torch.bool, device=positions.device)
    blocked[idx_fill[outlier]] = True
    index, whole = lookback_windows(positions, torch.zeros_like(positions), blocked, filler.lookback,
                                    filler.lookback_start)
    return index[idx_fill], ~whole[idx_fill]


def _token_set(ids: int | Sequence[int] | None) -> set[int]:
    return {ids} if isinstance(ids, int) else set(ids or ())


def _ended(row: list[int], eos: set[int], stop: Callable[[list[int]], bool] | None) -> bool:
    """Whether a row's decoding ends after its last token: an end-of-sequence token, or `stop` says so."""
    return row[-1] in eos or (stop is not None and bool(stop(row)))
