"""llama.cpp with ridgefill's patch, driven through llama-cpp-python's low-level API (ctypes).

The patch (ridgefill.patch, applied by build.py) gives llama.cpp a fill of its own: `llama_ridgefill_set_maps` copies
a split's maps into a backend buffer, `llama_ridgefill_set_fill` puts the next `llama_decode` calls in fill mode
(their ubatches run layers 0..S-1 and then, for each late layer, only the map's prediction, that layer's input
norm, its K/V projection, k-norm and RoPE and the cache store), and the filled ubatches report their split-state
norms. This module splits a prompt into runs by the fill rule (torchfill/rows.py: keep-first, tail, kept rows in
full; the rest filled) and calls `llama_decode` once per run (and per `n_batch` rows): there is no Python in the
per-layer path. Outliers (torchfill/rows.py `outliers`, torchfill's rule: per chunk of `chunk` rows, the
median of its filled rows' split-state norms) are found from the norms of the filled runs; a chunk with outliers
has its cache removed from the first outlier on and runs again from there with those rows in full (their split
states, and so their norms, do not depend on the fill: layers below the split run exactly for every row).

Every failure a user can cause is one line (RidgefillError): the build (library.py: missing, stale, for another CPU;
`make install` builds the right one), a model the fill does not run, a refusal of the patch's C API (its
LLAMA_RIDGEFILL_ERR_* codes, turned into lines here). The fill proves itself: after every filled
`llama_decode` the rows llama.cpp reports filled (their split-state norms, by position) must be the rows the plan
fills, and the tally counts llama.cpp's rows, not the plan's.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.llamacpp import library
from ridgefill.backends.llamacpp.gguf_header import FAMILIES, check_family, gguf_architecture  # noqa: F401
from ridgefill.backends.llamacpp.maps import Maps, maps_of  # noqa: F401
from ridgefill.torchfill.rows import outliers as outlier_rows
from ridgefill.errors import RidgefillError

KV_TYPES = {"f16": 1, "f32": 0}  # ggml types of the K/V cache the fill writes (a quantized cache is refused)
# llama.h's LLAMA_RIDGEFILL_ERR_* codes of llama_ridgefill_set_maps, and of llama_decode in fill mode
SET_MAPS_REFUSALS = {
    -1: "bad arguments (split, rank or the arrays given)",
    -2: "the fill does not support this architecture",
    -3: "no memory for them",
    -4: "their number is not that of this model's layers after the split",
    -5: "their width is not this model's",
    -6: "their key scale's KV heads are not this model's",
}
DECODE_REFUSALS = {
    -20: "a row of a filled run asks for logits: logits come only from rows that run in full",
    -21: "llama.cpp fills no rows of an embeddings context: use a generation context",
    -22: "a filled run holds rows of several sequences: fill one sequence per llama_decode",
}


class Stopped(Exception):
    """A prefill stopped by its `stop` callable (a server's client went away): the cache is in no known state until
    `clear`."""


@dataclass
class Prefill:
    """What a prefill gave: logits [len(rows), V] at the rows asked for (float32, CPU), the rows that were filled
    and those promoted to full as outliers."""

    logits: torch.Tensor
    rows: list[int]
    filled: int = 0
    outliers: int = 0
    runs: int = 0  # llama_decode calls
    promoted: list[int] = field(default_factory=list)
    reused: int = 0  # leading rows kept from the cache (prefill's `reuse`); counted in none of the above


class LlamaCpp:
    """One GGUF model and one context of the patched llama.cpp (CPU only; sequence 0)."""

    def __init__(self, path: str | Path, n_ctx: int, threads: int, n_batch: int = 2048, n_ubatch: int = 512,
                 kv_type: str = "f16", gpu_layers: int = 0, flash_attn: bool = True, eval_callback=None) -> None:
        """eval_callback: a ggml_backend_sched_eval_callback that sees every graph node llama.cpp computes (the
        tests read the filled graph's nodes with it; it must outlive the context)."""
        ll, lib = library.load()
        self.ll, self.lib = ll, lib
        if gpu_layers:
            raise RidgefillError(f"GPU offload ({gpu_layers} layers) is not supported with --engine llamacpp: "
                                 "it runs llama.cpp on the CPU")
        if kv_type not in KV_TYPES:
            raise RidgefillError(f"a {kv_type} K/V cache is not supported with --engine llamacpp: the fill writes an "
                                 f"unquantized cache ({', '.join(KV_TYPES)})")
        path = Path(path)
        if not path.is_file():
            raise RidgefillError(f"{path} is not a GGUF file: point --model at a .gguf file or an embedded alias")
        self.arch = check_family(path)
        library.quiet(ll)
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RidgefillError(f"llama.cpp cannot load {path}: check that it is a complete GGUF file")
        self.ctx = None
        self.batch = None
        self._owned = True  # the model and context are this driver's (attach: another owner's)
        try:
            cparams = ll.llama_context_default_params()
            cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, min(n_ubatch, n_batch)
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
            cparams.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
            cparams.no_perf = True
            if eval_callback is not None:
                cparams.cb_eval = eval_callback
            self.ctx = ll.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise RidgefillError(f"llama.cpp cannot make a context of {n_ctx} tokens for {path}: give a "
                                     "smaller context or free memory")
        except BaseException:
            self.close()
            raise
        self._bind(n_ctx, n_batch)

    @classmethod
    def attach(cls, arch: str, model, ctx, n_ctx: int, n_batch: int) -> "LlamaCpp":
        """A driver of a model and context that another owner made and frees (llama-cpp-python's `Llama`, whose
        context must be a generation context of one sequence, as __init__ makes them: CPU, unquantized K/V), of
        architecture `arch` (check_family's): its prefills fill by the same rule on that context; `close` frees only
        the driver's own batch."""
        self = cls.__new__(cls)
        self.ll, self.lib = library.load()
        self.arch = arch
        self.model, self.ctx, self.batch, self._owned = model, ctx, None, False
        self._bind(n_ctx, n_batch)
        return self

    def _bind(self, n_ctx: int, n_batch: int) -> None:
        ll = self.ll
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.n_layers = ll.llama_model_n_layer(self.model)
        self.n_embd = ll.llama_model_n_embd(self.model)
        self.n_head_kv = ll.llama_model_n_head_kv(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self.maps: Maps | None = None
        self.n_past = 0  # positions held in the cache
        # what the cache's rows are, as the prefills wrote them (rows a prefill did not write ran in full, unplanned:
        # decode steps): how llama.cpp last ran each (True: filled), the plan's kind before outliers (True: full),
        # and the split-state norms of the rows the plan filled (also those promoted to full as outliers)
        self._filled: dict[int, bool] = {}
        self._planned: dict[int, bool] = {}
        self._norms: dict[int, float] = {}
        self._logits: dict[int, np.ndarray] = {}  # a run's logits by position
        self.stop = None  # a callable asked before each llama_decode: True stops the prefill (Stopped; then clear())

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def close(self) -> None:
        ll = self.ll
        if getattr(self, "batch", None) is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if not getattr(self, "_owned", True):  # attached: the owner frees them
            self.ctx = self.model = None
            return
        if getattr(self, "ctx", None):
            ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "LlamaCpp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- maps ---------------------------------------------------------------------------------------------------
    def set_maps(self, maps: Maps) -> None:
        """Copy `maps` into llama.cpp (checked against this model's shape first)."""
        s, h, m = maps.split, self.n_embd, self.n_layers - maps.split - 1
        if not 1 <= s < self.n_layers:
            raise RidgefillError(f"split {s} is outside this model's 1..{self.n_layers - 1}: fit maps for this model")
        want = {"w": (m, h, h), "u": (m, maps.rank, h), "v": (m, h, maps.rank), "b": (m, h),
                "key_scale": (self.n_layers - s, self.n_head_kv)}
        for name, shape in want.items():
            a = getattr(maps, name)
            if a is not None and tuple(a.shape) != shape:
                raise RidgefillError(f"maps of split {s} hold {name} of shape {list(a.shape)}, not {list(shape)}, for "
                                     f"this {self.n_layers}-layer model of width {h}: fit maps for this model")

        def ptr(a):
            return None if a is None else a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

        arrays = [None if a is None else np.ascontiguousarray(a, dtype=np.float32)
                  for a in (maps.w, maps.u, maps.v, maps.b, maps.key_scale)]
        ret = self.lib.llama_ridgefill_set_maps(self.ctx, s, m, h, maps.rank, self.n_head_kv,
                                                *(ptr(a) for a in arrays))
        if ret != 0:
            why = SET_MAPS_REFUSALS.get(ret, f"code {ret}")
            raise RidgefillError(f"llama.cpp refused the maps of split {s}: {why}: fit maps for this model")
        self.maps = maps

    # --- runs ---------------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Empty the cache (and forget what its rows were)."""
        self.ll.llama_memory_clear(self.mem, True)
        self.n_past = 0
        self._filled, self._planned, self._norms = {}, {}, {}

    def _decode(self, tokens: list[int], start: int, fill: bool, outputs=frozenset()) -> None:
        """Run tokens at positions start.. (fill mode or not), n_batch rows per llama_decode; the logits of the
        positions in `outputs` go to self._logits, a filled run's split-state norms to self._norms, and every row's
        kind as llama.cpp ran it (True: filled, by its own report) to self._filled."""
        ret = self.lib.llama_ridgefill_set_fill(self.ctx, True) if fill else 0
        if ret != 0:
            raise RidgefillError(DECODE_REFUSALS.get(ret, "no maps are set for a filled run"))
        try:
            b = self.batch
            for lo in range(0, len(tokens), self.n_batch):
                part = tokens[lo:lo + self.n_batch]
                index = {}
                for i, tok in enumerate(part):
                    pos = start + lo + i
                    b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                    b.seq_id[i][0] = 0
                    out = pos in outputs  # in a filled run llama.cpp refuses it (a filled row has no logits)
                    b.logits[i] = out
                    if out:
                        index[pos] = i
                b.n_tokens = len(part)
                if self.stop is not None and self.stop():
                    raise Stopped(f"stopped before positions {start + lo}..{start + lo + len(part) - 1}")
                ret = self.ll.llama_decode(self.ctx, b)
                if fill and ret in DECODE_REFUSALS:
                    raise RidgefillError(DECODE_REFUSALS[ret])
                if ret != 0:
                    raise RidgefillError(f"llama.cpp's decode failed (code {ret}) at positions {start + lo}.."
                                         f"{start + lo + len(part) - 1} (a context of {self.n_ctx} tokens)")
                rows = range(start + lo, start + lo + len(part))
                if fill:
                    self._norms.update(self._read_norms(rows))
                self._filled.update((p, fill) for p in rows)
                for pos, i in index.items():
                    self._logits[pos] = self._row(i)
            self.n_past = start + len(tokens)
        finally:
            if fill:
                self.lib.llama_ridgefill_set_fill(self.ctx, False)

    def _row(self, i: int) -> np.ndarray:
        p = self.ll.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def _read_norms(self, rows: range) -> dict[int, float]:
        """The split-state norms llama.cpp recorded for the filled rows of its last decode, checked to be exactly
        `rows`: a graph without the fill hook (another architecture, a hook lost in a rebase) records none and
        computed the rows in full, which would be timed and counted as filled."""
        n = self.lib.llama_ridgefill_n_norms(self.ctx)
        pos = np.ctypeslib.as_array(self.lib.llama_ridgefill_norm_pos(self.ctx), shape=(n,)).tolist() if n else []
        if pos != list(rows):
            raise RidgefillError(f"llama.cpp filled {n} of the {len(rows)} rows its plan fills at positions "
                                 f"{rows.start}..{rows.stop - 1}: its {self.arch} graph does not run ridgefill's "
                                 f"fill; use --engine torchfill for this model")
        norms = np.ctypeslib.as_array(self.lib.llama_ridgefill_norms(self.ctx), shape=(n,))
        return dict(zip(pos, norms.tolist()))

    def prefill(self, tokens: list[int], full: list[bool] | None = None, outputs: list[int] = (),
                outlier_factor: float = 0.0, chunk: int = 2048, reuse: int = 0) -> Prefill:
        """Prefill `tokens`. full [n] (None: all): the rows that run the whole model; the rest are filled (maps set by
        set_maps). outputs: rows whose logits come back. Outliers among the filled rows (outlier_factor > 0, per
        chunk of `chunk` rows) run in full instead.

        reuse: the cache's first `reuse` rows hold these tokens (the caller compared them: llama-cpp-python's prefix
        match); of those, the rows before `reusable`'s cut are kept and the rest run again, so the cache ends as a
        fresh prefill of `tokens` would leave it. 0: the cache is cleared first."""
        n = len(tokens)
        if n == 0 or n > self.n_ctx:
            raise RidgefillError(f"a prompt of {n} tokens does not fit the context of {self.n_ctx} tokens")
        planned = [True] * n if full is None else list(full)
        if not all(planned) and self.maps is None:
            raise RidgefillError("no maps are set for a filled prefill")
        start = self.reusable(planned, min(reuse, n - 1, *outputs), outlier_factor, chunk)
        if start == 0:
            self.clear()
        else:
            self.ll.llama_memory_seq_rm(self.mem, 0, start, -1)
        for record in (self._filled, self._planned, self._norms):
            for p in [p for p in record if p >= start]:
                del record[p]
        self._planned.update((p, planned[p]) for p in range(start, n))
        self._logits = {}
        want = set(outputs)
        full = list(planned)  # the kinds the rows end up with (outliers promoted)
        first = start  # the first row computed here
        result = Prefill(torch.empty(0), list(outputs))
        for c0 in range(start - start % chunk, n, chunk):
            c1 = min(n, c0 + chunk)
            result.runs += self._runs(tokens, full, max(c0, start), c1, want)
            decided = self._decided(planned, c0, c1, outlier_factor)
            wrong = self._first_unlike(decided, c0)
            if wrong is not None:  # run again from the first row that ran otherwise (outliers in full)
                full[c0:c1] = decided
                self.ll.llama_memory_seq_rm(self.mem, 0, wrong, -1)
                result.runs += self._runs(tokens, full, wrong, c1, want)
                first = min(first, wrong)
        self.n_past = n
        computed = range(first, n)
        result.reused = first
        result.filled = sum(self._filled[p] for p in computed)  # llama.cpp's own count: the rows it filled
        result.promoted = [p for p in computed if full[p] and not planned[p]]
        result.outliers = len(result.promoted)
        result.logits = torch.from_numpy(np.stack([self._logits[p] for p in outputs])) if outputs else \
            torch.empty(0, self.n_vocab)
        self._logits = {}
        return result

    def reusable(self, planned: list[bool], reuse: int, outlier_factor: float, chunk: int) -> int:
        """How many of the cache's first `reuse` rows (the new prompt's own tokens) a prefill planned as `planned`
        keeps: the rows before the first one a fresh prefill would compute otherwise. A row the plan runs in full is
        kept only where it ran in full; a row the plan fills only where its split-state norm is known (it ran
        filled, or was promoted as an outlier), and a whole chunk's rows only where its outlier decisions, made
        again on those norms, are how the rows ran. The chunk the cut falls in is judged once its rest has run
        (prefill: `_first_unlike`)."""
        cut = next((r for r in range(reuse) if (self._filled.get(r, False) if planned[r] else r not in self._norms)),
                   reuse)
        for c0 in range(0, cut, chunk):
            c1 = min(c0 + chunk, len(planned))
            if c1 > cut:
                break
            wrong = self._first_unlike(self._decided(planned, c0, c1, outlier_factor), c0)
            if wrong is not None:
                return wrong
        return cut

    def _decided(self, planned: list[bool], c0: int, c1: int, outlier_factor: float) -> list[bool]:
        """Rows c0..c1-1 of a chunk as a fresh prefill runs them (True: full): the plan's, and the outliers among
        the rows it fills (their norms) in full."""
        decided = planned[c0:c1]
        filled = [p for p in range(c0, c1) if not planned[p]]
        if outlier_factor > 0 and filled:
            norms = torch.tensor([self._norms[p] for p in filled])
            out = outlier_rows(norms, torch.zeros(len(filled), dtype=torch.long),
                               torch.ones(len(filled), dtype=torch.bool), outlier_factor)
            for p, o in zip(filled, out.tolist()):
                decided[p - c0] = decided[p - c0] or bool(o)
        return decided

    def _first_unlike(self, decided: list[bool], c0: int) -> int | None:
        """The first row from c0 whose kind as it ran is not `decided`'s, or None."""
        return next((c0 + i for i, f in enumerate(decided) if self._filled.get(c0 + i, False) == f), None)

    def _runs(self, tokens, full, lo, hi, want) -> int:
        """Rows lo..hi-1 as runs of equal kind (full or filled), in order; returns llama_decode calls."""
        calls, p = 0, lo
        while p < hi:
            q = p
            while q < hi and full[q] == full[p]:
                q += 1
            self._decode(tokens[p:q], p, fill=not full[p], outputs=want)
            calls += -(-(q - p) // self.n_batch)
            p = q
        return calls

    def step(self, token: int) -> np.ndarray:
        """One decode step (the whole model) after the cache: the next logits [V]."""
        self._logits = {}
        self._decode([token], self.n_past, fill=False, outputs={self.n_past})
        return self._logits.pop(self.n_past - 1)

    def greedy(self, first_logits: np.ndarray | torch.Tensor, max_new_tokens: int, eos: int | None = None) -> list[int]:
        """Greedy tokens from the prefill's last logits on (ends at `eos`, when given)."""
        logits = np.asarray(first_logits)
        out: list[int] = []
        while len(out) < max_new_tokens:
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok == eos or len(out) == max_new_tokens:
                break
            logits = self.step(tok)
        return out

    # --- reading the cache back (tests) ----------------------------------------------------------------------------
    def kv_rows(self) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The cache of sequence 0 as llama.cpp holds it: (positions [n], K per layer [n, Hkv·D], V per layer
        [n, Hkv·D]) as float32, parsed from llama_state_seq_get_data (llama_kv_cache::state_write)."""
        ll = self.ll
        size = ll.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        got = ll.llama_state_seq_get_data(self.ctx, buf, size, 0)
        return parse_kv_state(bytes(buf)[:got])


_GGML_TYPES = {0: np.float32, 1: np.float16}


def parse_kv_state(data: bytes) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """llama_state_seq_get_data of one sequence (a magic number and the sequence id, then
    llama_kv_cache::state_write) on one stream, unquantized K/V: (positions, K, V)."""
    off = 8

    def take(fmt):
        nonlocal off
        vals = struct.unpack_from(fmt, data, off)
        off += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    n_stream = take("<I")
    if n_stream != 1:
        raise ValueError(f"{n_stream} K/V streams: one expected")
    cells = take("<I")
    positions = []
    for _ in range(cells):
        pos, n_seq = take("<iI")
        off += 4 * n_seq
        positions.append(pos)
    v_trans, n_layer = take("<II")
    ks, vs = [], []
    for _ in range(n_layer):
        t, row = take("<iQ")
        dt = np.dtype(_GGML_TYPES[t])
        ks.append(np.frombuffer(data, dt, cells * row // dt.itemsize, off).reshape(cells, -1).astype(np.float32))
        off += cells * row
    for _ in range(n_layer):
        if not v_trans:
            t, row = take("<iQ")
            dt = np.dtype(_GGML_TYPES[t])
            vs.append(np.frombuffer(data, dt, cells * row // dt.itemsize, off).reshape(cells, -1).astype(np.float32))
            off += cells * row
        else:
            t, el, width = take("<iII")
            dt = np.dtype(_GGML_TYPES[t])
            vs.append(np.frombuffer(data, dt, cells * width, off).reshape(width, cells).T.astype(np.float32))
            off += cells * width * el
    return np.array(positions), ks, vs
