"""Local attention for filled rows below the split (`--filled-window W`).

With a window, every filled row, in the windowed layers below the split, attends only to the sinks (the leading
`sinks` positions: the kept first rows) and to the W rows before it (positions p-W..p); full rows (tail, kept rows,
decode) attend to everything as without one. Layers at or above the split are untouched: there filled rows run no
attention. The work is O(rows x W) per layer, by one of two routes (torchfill/routes.py chooses):

- "blocks" (CPU): the windowed rows of a chunk go in blocks of consecutive rows, and a block attends to the sinks
  and the band of keys from W rows before its first row to its last row, masked per row (`window_blocks`), never
  to a masked full prefix;
- "flash_band" (CUDA): below the split every chunk row runs and is the last key, so the band of every row
  (positions p-W..p) is one fused sliding-window kernel call over the keys from W before the chunk to its end
  (`band_flash`: flash-attention's causal mask with window_size_left=W), returning each row's log-sum-exp; the
  sinks a row sees besides its band (positions s < min(sinks, p-W), at most `sinks` keys) are scored from q as it
  is (bf16 products summed in float32, `sink_scores`) and merged with the band in one float32 pass that rounds once
  (`merge_sinks`, the same on every device: the CPU's tests run it); the few rows that
  are not windowed then overwrite theirs with causal attention over every key. No loop over blocks, no host sync.
  "masked_band" is the same route with the band kernel's exact masked stand-in (`band_masked`, any device),
  which tests it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ridgefill.torchfill.attention import flash_cpu
from ridgefill.errors import RidgefillError


def check_window_size(window, name: str = "--filled-window") -> int:
    """The one rule of a filled window's size: an integer of at least 0 (0: full attention); returns it."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise RidgefillError(f"{name} {window} must be an integer of at least 0 (0: full attention)")
    return window


@dataclass(frozen=True)
class FilledWindow:
    """W = `size` rows before each windowed row, in layers `first`..`last` (inclusive; only those below the split
    window anything), besides the leading `sinks` positions."""

    size: int
    first: int
    last: int
    sinks: int = 1

    def __post_init__(self) -> None:
        check_window_size(self.size)
        for name in ("first", "last", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RidgefillError(f"filled window {name} {value!r} must be an integer of at least 0")
        if self.size < 1:
            raise RidgefillError(f"--filled-window {self.size} must be at least 1 (0 means no window: full "
                                 "attention)")
        if self.first > self.last:
            raise RidgefillError(f"--filled-window-layers {self.first}-{self.last} is empty: give first-last with "
                                 "first <= last")

    def layers(self, split: int) -> range:
        """The windowed layers at `split`: first..last, below the split."""
        return range(self.first, min(self.last + 1, split))

    def keys_per_row(self, position):
        """How many keys a windowed row at `position` (a number or a numpy array of them) attends to: itself, up to
        W rows before it, the sinks before those."""
        band = np.minimum(position, self.size) + 1
        return band + np.minimum(self.sinks, np.maximum(0, np.subtract(position, self.size)))

    def to_meta(self) -> dict:
        """What a statistics or maps file stores (the sinks are the kept first rows of the run that reads it)."""
        return {"size": self.size, "first": self.first, "last": self.last}


def parse_layers(text: str | None, split: int) -> tuple[int, int]:
    """--filled-window-layers 'a-b' (or one layer 'a') -> (a, b); None: every layer below `split`, 0..split-1."""
    if text is None or str(text).strip() == "":
        return 0, split - 1
    parts = str(text).strip().split("-")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or first < 0 or last < first:
        raise RidgefillError(f"--filled-window-layers '{text}' is not a layer range: give first-last, e.g. 0-{split - 1}")
    if last >= split:
        raise RidgefillError(f"--filled-window-layers '{text}' reaches layer {last}, at or above the split {split}: "
                             f"windowed layers lie below the split (at most {split - 1})")
    return first, last


@dataclass(frozen=True)
class WindowBlock:
    """A block of windowed rows and the keys it reads: rows [g] chunk-relative, keys [k] cache positions, mask
    [g, k] additive (0 where a row may attend, -inf elsewhere)."""

    rows: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor


def block_size(window: int) -> int:
    """Rows per block: a block costs each of its rows up to (block + W) keys, and each block one attention call;
    a quarter of W, between 32 and 256 rows."""
    return max(32, min(256, window // 4))


def window_blocks(rows: torch.Tensor, positions: torch.Tensor, window: FilledWindow,
                  dtype: torch.dtype) -> list[WindowBlock]:
    """The blocks of a chunk's windowed rows `rows` [nW] (chunk-relative, ascending) at absolute `positions` [nW]."""
    blocks, size = [], block_size(window.size)
    for b0 in range(0, len(rows), size):
        pos = positions[b0:b0 + size]  # [g]
        lo, hi = int(pos[0]) - window.size, int(pos[-1])
        keys = torch.arange(max(lo, 0), hi + 1, device=pos.device)
        sinks = torch.arange(min(window.sinks, max(lo, 0)), device=pos.device)
        keys = torch.cat([sinks, keys])  # [k] the sinks before the band, then the band
        allowed = (keys.unsqueeze(0) <= pos.unsqueeze(1)) & (
            (keys.unsqueeze(0) >= pos.unsqueeze(1) - window.size) | (keys.unsqueeze(0) < window.sinks))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, float("-inf"))
        blocks.append(WindowBlock(rows[b0:b0 + size], keys, mask))
    return blocks


def windowed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: list[WindowBlock],
                       scale: float, out: torch.Tensor) -> None:
    """Write into `out` [B, Hq, n, D] the attention of each block's rows (q [B, Hq, n, D], the chunk's queries) over
    its keys among the cached `keys` / `values` [B, Hkv, n_keys, D]."""
    gqa = q.shape[1] != keys.shape[1]
    for b in blocks:
        k, v = keys.index_select(2, b.keys), values.index_select(2, b.keys)  # [B, Hkv, k, D]
        attn = F.scaled_dot_product_attention(q.index_select(2, b.rows), k, v, attn_mask=b.mask, scale=scale,
                                              enable_gqa=gqa)
        out.index_copy_(2, b.rows, attn)


# --- the band route: one sliding-window kernel call, the sinks merged by log-sum-exp ------------------------------
# A band kernel: (q [B, Hq, nq, D] the last nq of the nk positions of k, v [B, Hkv, nk, D], W, scale) ->
# (out [B, Hq, nq, D], lse [B, Hq, nq] float32): each query over itself and the W keys before it.
def band_flash(q, k, v, window: int, scale: float):
    """The band through flash-attention's local (sliding-window) causal mask, lower-right aligned, GQA K/V as they
    are (CUDA, fp16/bf16; routes.py checks). Its layout is [B, L, H, D]; only the keywords torch 2.11 has."""
    nq, nk = q.shape[2], k.shape[2]
    out, lse = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, nq, nk, 0.0, True, False,
        scale=scale, window_size_left=window, window_size_right=0)[:2]
    return out.transpose(1, 2), lse  # [B, Hq, nq, D], [B, Hq, nq]


def band_masked(q, k, v, window: int, scale: float):
    """The band kernel's exact stand-in: the same contract through an explicit mask (O(nq x nk); the CPU's tests)."""
    nq, nk = q.shape[2], k.shape[2]
    qpos = torch.arange(nk - nq, nk, device=q.device).unsqueeze(1)
    kpos = torch.arange(nk, device=q.device).unsqueeze(0)
    allowed = (kpos <= qpos) & (kpos >= qpos - window)  # [nq, nk]
    if q.device.type == "cpu":
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        return flash_cpu(q, k, v, False, scale, mask)
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.repeat_interleave(groups, 1).float()) * scale
    lse = scores.masked_fill_(~allowed, float("-inf")).logsumexp(-1)  # [B, Hq, nq]
    out = torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1).float()
    return out.to(q.dtype), lse


BAND_KERNELS = {"flash_band": band_flash, "masked_band": band_masked}


def sink_scores(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, window: int,
                scale: float) -> torch.Tensor:
    """The scores [B, Hq, n, S] (float32) of q [B, Hq, n, D] at `positions` [n] against the sink keys k [B, Hkv, S, D]
    (positions 0..S-1), -inf where a sink lies in the row's band or after it (s >= p - W): computed as the flash
    kernel computes its own, bf16 products (exact in float32) summed in float32, without a float32 copy of q. One
    GEMM of every query row against every KV head's sinks (Hkv x S columns: a handful), each head's own picked after;
    q is read in the layout it has ([B, n, Hq, D] behind a transpose, as the projections leave it, or contiguous).
    On CUDA the GEMM takes bf16/fp16 and writes float32 (torch.bmm's out_dtype: CUDA only, fp16/bf16 -> fp32);
    elsewhere (the CPU: tests, not the speed target) it runs in float32."""
    b, hq, n, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    heads_last = not q.is_contiguous() and q.transpose(1, 2).is_contiguous()
    rows = q.transpose(1, 2).reshape(b, n * hq, d) if heads_last else q.reshape(b, hq * n, d)  # views
    keys = k.reshape(b, hkv * s, d).transpose(1, 2)  # [B, D, Hkv*S]
    if rows.dtype in (torch.float16, torch.bfloat16) and rows.device.type in ("cuda", "meta"):
        every = torch.bmm(rows, keys, out_dtype=torch.float32)
    else:
        every = torch.bmm(rows.float(), keys.float())
    own = torch.arange(hq, device=q.device) // (hq // hkv)  # q head h reads K/V head h // (Hq / Hkv)
    if heads_last:
        picked = every.view(b, n, hq, hkv, s).gather(3, own.view(1, 1, hq, 1, 1).expand(b, n, hq, 1, s))
        scores = picked.view(b, n, hq, s).transpose(1, 2)
    else:
        picked = every.view(b, hq, n, hkv, s).gather(3, own.view(1, hq, 1, 1, 1).expand(b, hq, n, 1, s))
        scores = picked.view(b, hq, n, s)
    seen = torch.arange(s, device=q.device).unsqueeze(0) < (positions - window).unsqueeze(1)  # [n, S]
    return scores.mul(scale).masked_fill_(~seen, float("-inf"))


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The band's attention (out [B, Hq, n, D] in its dtype, lse [B, Hq, n] float32) merged with the sinks' (their
    scores [B, Hq, n, S] float32, -inf where unseen; their values v [B, Hkv, S, D]): with L the log-sum-exp of all
    of a row's keys, out * exp(lse - L) + sum_s exp(score_s - L) v_s, computed in float32 and rounded once into
    out's dtype. Per element of out: one small GEMM writes the sinks' part (K = S), and one fused pass reads out and
    that part and writes the result (addcmul computes in float32 and casts on store). Every device runs this."""
    total = torch.logaddexp(lse, scores.logsumexp(-1))  # [B, Hq, n]; rows that see no sink: lse itself
    band_share = (lse - total).exp_().unsqueeze(-1)  # [B, Hq, n, 1]
    weights = (scores - total.unsqueeze(-1)).exp_()  # [B, Hq, n, S]; 0 where unseen
    groups = out.shape[1] // v.shape[1]
    sinks = weights @ v.float().repeat_interleave(groups, 1)  # [B, Hq, n, D] float32 (v: S rows per head)
    return torch.addcmul(sinks, out, band_share, out=torch.empty_like(out))


def banded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, positions: torch.Tensor,
                     window: FilledWindow, scale: float, kernel) -> torch.Tensor:
    """Every chunk row (q [B, Hq, n, D] at positions start..start+n-1, the last n of the cached keys/values
    [B, Hkv, start+n, D]) over its band and its sinks, by the band `kernel` -> [B, Hq, n, D]."""
    n, w = q.shape[2], window.size
    lo = max(0, start - w)  # the first key of the first row's band
    out, lse = kernel(q, keys[:, :, lo:], values[:, :, lo:], w, scale)
    sinks = min(window.sinks, max(0, start + n - 1 - w))  # sinks that some row sees outside its band
    if sinks == 0:
        return out
    return merge_sinks(out, lse, sink_scores(q, keys[:, :, :sinks], positions, w, scale), values[:, :, :sinks])
