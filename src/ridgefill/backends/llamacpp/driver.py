"""llama.cpp with ridgefill's patches, driven through llama-cpp-python's low-level API (ctypes).

The library patch (patches/libllama.patch, applied by build.py) gives llama.cpp a fill of its own and the plan of it:
`llama_ridgefill_set_maps` copies a split's maps into a backend buffer (`llama_adapter_ridgefill_init` reads them
from a GGUF adapter), fill mode makes `llama_decode`'s ubatches run layers 0..S-1 and then, for each late layer, only
the map's prediction, that layer's input norm, its K/V projection, k-norm and RoPE and the cache store, and
`llama_ridgefill_prefill` runs a prompt by the plan, written once in libllama for this driver and for llama-server:
the fill rule (keep-first, tail, kept rows in full; the rest filled: the rule of torchfill/rows.py), runs of equal
kind each its own `llama_decode` (n_batch rows at most: no Python in the per-layer path), the outlier rule by chunk
(torchfill's: per chunk of `chunk` rows, a filled row whose split-state norm exceeds the factor times the lower
median of the chunk's filled rows' norms runs in full; the chunk runs again from its first outlier on), and which
cached rows a new prompt keeps (`llama_ridgefill_reusable`).

Every failure a user can cause is one line (RidgefillError): the build (library.py: missing, stale, for another CPU;
`make install` builds the right one), a model the fill does not run, a refusal of the patch's C API (its
LLAMA_RIDGEFILL_ERR_* codes, turned into lines here). The fill proves itself: after every filled `llama_decode` the
plan checks that the rows llama.cpp reports filled (their split-state norms, by position) are the rows it fills
(LLAMA_RIDGEFILL_ERR_FILLED otherwise), and the tally counts llama.cpp's rows as it ran them
(`llama_ridgefill_get_rows`), not the plan's.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.llamacpp import library
from ridgefill.backends.llamacpp.gguf_header import check_family
from ridgefill.backends.llamacpp.maps import Maps
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
ERR_NO_MAPS, ERR_FILLED = -7, -8
DECODE_REFUSALS = {
    -20: "a row of a filled run asks for logits: logits come only from rows that run in full",
    -21: "llama.cpp fills no rows of an embeddings context: use a generation context",
    -22: "a filled run holds rows of several sequences: fill one sequence per llama_decode",
}


class Stopped(Exception):
    """A prefill stopped by its `stop` callable (a server's client went away): the cache is in no known state until
    `clear`."""


@dataclass(frozen=True)
class Rows:
    """A prompt's fill rule as llama.cpp's plan takes it (llama.h's struct llama_ridgefill_plan): its last `tail`
    rows, its first `keep_first` rows and `keep_rows` run the whole model; every other row is filled."""

    tail: int = 0
    keep_first: int = 0
    keep_rows: tuple[int, ...] = ()

    @classmethod
    def of(cls, full: list[bool]) -> "Rows":
        """The rule of a mask [n] (True: a row that runs in full)."""
        return cls(0, 0, tuple(i for i, f in enumerate(full) if f))


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
        self.n_past = 0  # positions held in the cache (what its rows are, llama.cpp's plan records: prefill)
        self._logits: dict[int, np.ndarray] = {}  # a decode step's logits by position
        self.stop = None  # a callable asked before each llama_decode: True stops the prefill (Stopped; then clear())

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def close(self) -> None:
        ll = self.ll
        if getattr(self, "ctx", None) and getattr(self, "_adapter", None):
            self.lib.llama_set_adapter_ridgefill(self.ctx, None)
            self._free_adapter()
        if getattr(self, "batch", None) is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
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
        """Copy `maps` into llama.cpp (checked against this model's shape first); maps with an adapter file are read
        by libllama itself (llama_adapter_ridgefill_init, as llama-server reads them)."""
        s, h, m = maps.split, self.n_embd, self.n_layers - maps.split - 1
        if not 1 <= s < self.n_layers:
            raise RidgefillError(f"split {s} is outside this model's 1..{self.n_layers - 1}: fit maps for this model")
        if maps.adapter is not None:
            self._set_adapter(maps)
            return
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
        self._free_adapter()
        self.maps = maps

    def _set_adapter(self, maps: Maps) -> None:
        adapter = self.lib.llama_adapter_ridgefill_init(self.model, str(maps.adapter).encode())
        if not adapter:
            raise RidgefillError(f"llama.cpp refused the adapter {maps.adapter} (llama_adapter_ridgefill_init): "
                                 "convert the maps for this model (ridgefill convert-maps)")
        ret = self.lib.llama_set_adapter_ridgefill(self.ctx, adapter)
        if ret != 0:
            self.lib.llama_adapter_ridgefill_free(adapter)
            raise RidgefillError(f"llama.cpp refused the adapter {maps.adapter}: "
                                 f"{SET_MAPS_REFUSALS.get(ret, f'code {ret}')}")
        self._free_adapter()
        self._adapter, self.maps = adapter, maps

    def _free_adapter(self) -> None:
        """Free the adapter llama.cpp held before (the context holds the new maps now)."""
        old, self._adapter = getattr(self, "_adapter", None), None
        if old:
            self.lib.llama_adapter_ridgefill_free(old)

    # --- runs ---------------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Empty the cache (and forget what its rows were)."""
        self.ll.llama_memory_clear(self.mem, True)
        self.lib.llama_ridgefill_reusable(self.ctx, 0, ctypes.byref(library.Plan(chunk=1)), 1, 0)
        self.n_past = 0

    def _decode(self, tokens: list[int], start: int, outputs=frozenset()) -> None:
        """Run tokens at positions start.. through the whole model (decode steps), n_batch rows per llama_decode; the
        logits of the positions in `outputs` go to self._logits."""
        b = self.batch
        for lo in range(0, len(tokens), self.n_batch):
            part = tokens[lo:lo + self.n_batch]
            index = {}
            for i, tok in enumerate(part):
                pos = start + lo + i
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0] = 0
                b.logits[i] = pos in outputs
                if pos in outputs:
                    index[pos] = i
            b.n_tokens = len(part)
            ret = self.ll.llama_decode(self.ctx, b)
            if ret != 0:
                raise RidgefillError(f"llama.cpp's decode failed (code {ret}) at positions {start + lo}.."
                                     f"{start + lo + len(part) - 1} (a context of {self.n_ctx} tokens)")
            for pos, i in index.items():
                self._logits[pos] = self._row(i)
        self.n_past = start + len(tokens)

    def _row(self, i: int) -> np.ndarray:
        p = self.ll.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def prefill(self, tokens: list[int], full: "Rows | list[bool] | None" = None, outputs: list[int] = (),
                outlier_factor: float = 0.0, chunk: int = 2048, reuse: int = 0) -> Prefill:
        """Prefill `tokens` by llama.cpp's fill plan (llama_ridgefill_prefill: the plan is written once, in the
        patched libllama, for this driver and for llama-server). full: the rows that run the whole model, as a rule
        (Rows), a mask [n] (True: full) or None (all); the rest are filled (maps set by set_maps). outputs: rows whose
        logits come back (rows the plan runs in full). Outliers among the filled rows (outlier_factor > 0, per chunk
        of `chunk` rows) run in full instead.

        reuse: the cache's first `reuse` rows hold these tokens (the caller compared them); of those, llama.cpp keeps
        the rows a fresh prefill would leave as they are (llama_ridgefill_reusable) and runs the rest again, so the
        cache ends as a fresh prefill of `tokens` would leave it. 0: the cache is cleared first."""
        n = len(tokens)
        if n == 0 or n > self.n_ctx:
            raise RidgefillError(f"a prompt of {n} tokens does not fit the context of {self.n_ctx} tokens")
        rows = Rows(0, n) if full is None else full if isinstance(full, Rows) else Rows.of(full)
        plan = self._plan(rows, n, outlier_factor, chunk)
        mask = (ctypes.c_bool * n)()
        if self.lib.llama_ridgefill_plan_rows(ctypes.byref(plan), n, mask) > 0 and self.maps is None:
            raise RidgefillError("no maps are set for a filled prefill")
        if any(not mask[p] for p in outputs):
            raise RidgefillError(DECODE_REFUSALS[-20])
        start = self.lib.llama_ridgefill_reusable(self.ctx, 0, ctypes.byref(plan), n, min(reuse, n - 1, *outputs))
        toks = (ctypes.c_int32 * n)(*tokens)
        outs = (ctypes.c_int32 * max(len(outputs), 1))(*outputs)
        logits = np.zeros((len(outputs), self.n_vocab), dtype=np.float32)  # [len(outputs), V]
        result = Prefill(torch.empty(0), list(outputs))
        pos = first = start
        while pos < n:
            if self.stop is not None and self.stop():
                raise Stopped(f"stopped before positions {pos}..{n - 1}")
            stats = library.Stats()
            ret = self.lib.llama_ridgefill_prefill(self.ctx, 0, toks, n, pos, n, self.n_batch, ctypes.byref(plan),
                                                   outs, len(outputs),
                                                   logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                   ctypes.byref(stats))
            if ret != 0:
                raise RidgefillError(self._refusal(ret, pos, n))
            first, pos, result.runs = min(first, stats.n_first), stats.n_past, result.runs + stats.n_decode
        self.n_past = n
        kinds, _ = self.rows_ran(first, n)
        result.reused = first
        result.filled = sum(k == library.ROW_FILLED for k in kinds)  # llama.cpp's own count: the rows it filled
        result.promoted = [first + i for i, k in enumerate(kinds) if k == library.ROW_OUTLIER]
        result.outliers = len(result.promoted)
        result.logits = torch.from_numpy(logits)
        return result

    def rows_ran(self, p0: int, p1: int) -> tuple[list[int], list[float]]:
        """How rows p0..p1-1 of the cache ran (library.ROW_*: llama.cpp's plan's records) and the split-state norms of
        the rows the plan filled (NaN for the others)."""
        kinds, norms = (ctypes.c_uint8 * (p1 - p0))(), (ctypes.c_float * (p1 - p0))()
        self.lib.llama_ridgefill_get_rows(self.ctx, 0, p0, p1, kinds, norms)
        return list(kinds), list(norms)

    @staticmethod
    def _plan(rows: "Rows", n: int, outlier_factor: float, chunk: int) -> library.Plan:
        outside = [r for r in rows.keep_rows if not 0 <= r < n]
        if outside:
            raise RidgefillError(f"keep row {outside[0]} is outside the {n}-token prompt (rows 0..{n - 1}): keep "
                                 "rows inside the prompt")
        keep = (ctypes.c_int32 * max(len(rows.keep_rows), 1))(*rows.keep_rows)
        plan = library.Plan(rows.tail, rows.keep_first, outlier_factor, chunk, keep, len(rows.keep_rows))
        plan._keep = keep  # the array lives as long as the plan
        return plan

    def _refusal(self, ret: int, pos: int, n: int) -> str:
        """The one line of a failed llama_ridgefill_prefill (its LLAMA_RIDGEFILL_ERR_* codes, or llama_decode's)."""
        if ret in DECODE_REFUSALS:
            return DECODE_REFUSALS[ret]
        if ret == ERR_FILLED:
            return (f"llama.cpp did not fill the rows its plan fills from position {pos}: its {self.arch} graph does "
                    "not run ridgefill's fill; use --engine torchfill for this model")
        if ret == ERR_NO_MAPS:
            return "no maps are set for a filled prefill"
        return (f"llama.cpp's decode failed (code {ret}) at positions {pos}..{n - 1} (a context of {self.n_ctx} "
                "tokens)")

    def step(self, token: int) -> np.ndarray:
        """One decode step (the whole model) after the cache: the next logits [V]."""
        self._logits = {}
        self._decode([token], self.n_past, outputs={self.n_past})
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
