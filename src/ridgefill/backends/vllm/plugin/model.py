"""vLLM's Llama, Qwen2, Qwen3 and Qwen3-Next models with RidgeFill's filled prefill (imported only inside vLLM
processes).

Each class is the stock vLLM class plus `ridgefill` state: the fitted maps and, per late attention layer, its input
norm, K/V projection rows and k-norm stacked at weight-loading time as torchfill stacks them
(torchfill/kv_stack.py; vLLM's CPU linear layers repack and drop `weight` afterwards).
A step whose batch has no filled token (decode steps, short prompts, the plugin unconfigured) runs the stock
forward unchanged. A step with filled tokens (the model runner passes a FillBatch, backends/vllm/plugin/runner.py):

- layers 0..S-1 run on every token, as stock;
- x, the residual stream entering layer S, is the split state; filled rows whose norm is an outlier run in full,
  and so do, with maps of lookback K, filled rows whose window (the K tokens before them, torchfill/lookback.py) is
  not among this step's tokens of their request (the first K of a prefill chunk) or holds an outlier;
- for each late layer l = S..L-1 the filled rows' K/V come from the predicted input (x for l = S, the map's
  prediction after) through that layer's own input norm, K/V rows of its (tensor-parallel shard of) qkv_proj,
  k-norm (Qwen3, Qwen3-Next), key scale and RoPE (vLLM's tables, partial in Qwen3-Next) at the true positions,
  computed by torchfill (torchfill/projection.py layer_kv, its own projection), and are written
  into the paged cache;
- the full rows alone run layers S..L-1 (attention over every cached key up to their position, then the MLP);
- a hybrid's late Gated DeltaNet layers (Qwen3-Next) run their mixer over every row of the step in position order,
  filled rows bringing their predicted input, so the request's recurrent and conv states advance over all of them;
  the full rows alone keep the mixer's output and run the MLP (`linear_layer`);
- hidden states come back for full rows only (filled rows get zeros: vLLM samples only from a request's last
  scheduled token, and a chunk that ends on a filled row is not the prompt's last, so its sample is dropped).

The maps are read whole into private memory when the weights load, and must hash to the sha256 `ridgefill serve`
checked (RIDGEFILL_MAPS_SHA256): every tensor-parallel rank serves the same maps, and changing the file while the
server runs changes nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from ridgefill.torchfill import Filler, late_inputs_by_layer
from ridgefill.torchfill.families.base import KVWeights
from ridgefill.torchfill.kv_stack import StackedKV, stack_weights
from ridgefill.torchfill.lookback import lookback_windows, window_states
from ridgefill.torchfill.projection import layer_kv
from ridgefill.errors import RidgefillError
from ridgefill.method.maps import load_filler
from ridgefill.runtime.models import checkpoint_fingerprint
from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.fill import fill_from_env
from ridgefill.backends.vllm.config import check_vllm_config
from ridgefill.backends.counters import FillCounters
from ridgefill.backends.vllm.plugin.private import (cpu_gemm, decoder_layers, embed, final_norm, gdn_core, gdn_core_inputs,
                                          gdn_mixer, gdn_output, gdn_split_forward, kv_layout, layer_mlp,
                                          layer_norms, layer_scales, layer_type, norm_params, paged_attention,
                                          rope_table, rotary, self_attention)
from ridgefill.backends.vllm.plugin.rows import outlier_tokens, segments
from ridgefill.backends.vllm.plugin.runner import StepLog


@dataclass
class LateKV:
    """One late attention layer's filled K/V projection, for torchfill/projection.py layer_kv: its input norm, the K and
    V rows of its local qkv_proj shard and its k-norm, stacked as the engine stacks them."""

    stack: StackedKV
    key_scale: torch.Tensor | None = None  # [local KV heads]: the maps' key-scale correction of this shard


def late_kv(layer, index: int, key_scale: torch.Tensor | None) -> LateKV:
    """The LateKV of decoder layer `index` (copied from its modules while vLLM still holds their weights)."""
    attn = self_attention(layer)
    if not rope_table(rotary(attn))[1]:
        raise RidgefillError(f"layer {index} rotates its keys GPT-J style (interleaved): the fill supports the NeoX "
                             "(rotate-half) RoPE of Llama, Qwen2, Qwen3 and Qwen3-Next; serve this model without maps")
    kv = kv_layout(attn)
    weight, bias, k_norm = kv.qkv_weight, kv.qkv_bias, kv.k_norm
    input_norm = layer_norms(layer)[0]
    weights = KVWeights(norm_weight(input_norm), norm_params(input_norm)[1],
                        weight[kv.k_rows].detach(), None if bias is None else bias[kv.k_rows].detach(),
                        weight[kv.v_rows].detach(), None if bias is None else bias[kv.v_rows].detach(),
                        None if k_norm is None else norm_weight(k_norm),
                        0.0 if k_norm is None else norm_params(k_norm)[1])
    stack = stack_weights([weights], [index], None, kv.kv_heads, kv.head_dim, weight.dtype, weight.device)
    return LateKV(stack, key_scale)


def norm_weight(norm) -> torch.Tensor:
    """The weight a vLLM RMSNorm multiplies by, in float32: its weight, or 1 + weight for the zero-centred
    GemmaRMSNorm (Qwen3-Next)."""
    weight = norm_params(norm)[0].detach().float()
    return weight + 1.0 if isinstance(norm, GemmaRMSNorm) else weight


def rope_at(rotary_emb, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's RoPE tables at `positions` [n] in the layout the engine applies (torchfill/families/base.py apply_rope):
    cos, sin [n, Dr]. A row of vLLM's cos_sin_cache holds the cos, then the sin, of the Dr/2 frequencies; the NeoX
    style rotates the two halves of the rotated dims by the same angles, so each is repeated."""
    cos, sin = rope_table(rotary_emb)[0][positions.long()].to(dtype).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable:
    """x [N, in] -> x·weightᵀ + bias, run as vLLM runs its own linear layers: on a CPU through vLLM's CPU GEMM
    dispatch (private.cpu_gemm); elsewhere torch's F.linear."""
    if weight.device.type != "cpu":
        return functools.partial(F.linear, weight=weight, bias=bias)
    return cpu_gemm(weight, bias)


@dataclass
class FillState:
    fill: FillSettings
    filler: Filler
    split: int
    late: list[LateKV | None]  # layers S..L-1 (None: a linear layer)
    counters: FillCounters  # what every step since loading did (the tally, and /metrics on rank 0)
    log: StepLog = field(default_factory=StepLog)  # requests whose prefill is under way

    def count(self, **added: int) -> None:
        self.counters.count(**added)


class RidgeFillMixin:
    """Adds the filled forward to a stock vLLM causal LM whose decoder layers are (positions, h, residual) ->
    (h, residual) with `input_layernorm` and `self_attn.{qkv_proj, q_size, kv_size, head_dim, rotary_emb, attn}`."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # the stock model's __init__ (next in MRO)
        fill = fill_from_env()
        if fill is not None:
            check_vllm_config(vllm_config, fill)
        self._ridgefill_fill = fill
        self._ridgefill_folder = vllm_config.model_config.model
        self.ridgefill: FillState | None = None

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        if self._ridgefill_fill is not None:
            self.ridgefill = self._load_fill_state(self._ridgefill_fill)
        return loaded

    def _load_fill_state(self, fill: FillSettings) -> FillState:
        layers = decoder_layers(self.model)
        ref = norm_params(layer_norms(layers[0])[0])[0]
        info = {"weights_hash": checkpoint_fingerprint(self._ridgefill_folder)}
        filler, meta = load_filler(fill.maps, info, dtype=ref.dtype, device=ref.device, sha256=fill.maps_sha256)
        if meta["n_layers"] != len(layers):
            raise RidgefillError(f"{fill.maps} holds maps for {meta['n_layers']} layers, the model has {len(layers)}")
        late = []
        for j, layer in enumerate(layers[filler.split:]):
            if layer_kind(layer) != "attention":  # a linear layer: no K/V, its mixer runs over the filled rows
                late.append(None)
                continue
            scale = None if filler.key_scale is None else local_heads(filler.key_scale[j], self_attention(layer))
            late.append(late_kv(layer, filler.split + j, scale))
        if hasattr(filler, "use_gemm"):  # each map as vLLM runs a linear layer (prepacked on a CPU), layer by layer
            filler.use_gemm(linear)
        return FillState(fill, filler, filler.split, late, FillCounters(publish=get_tensor_model_parallel_rank() == 0))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, ridgefill_batch=None):
        if ridgefill_batch is None or self.ridgefill is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        return filled_forward(self.model, self.ridgefill, ridgefill_batch, input_ids, positions, inputs_embeds)


def filled_forward(model, state: FillState, batch, input_ids, positions, inputs_embeds) -> torch.Tensor:
    """The decoder stack of one step with filled rows; returns the final-normed hidden states [N, H]."""
    h = inputs_embeds if inputs_embeds is not None else embed(model, input_ids)  # [N, H]
    residual = None
    layers, s = decoder_layers(model), state.split
    for layer in layers[:s]:
        h, residual = layer(positions=positions, hidden_states=h, residual=residual)
    x = h if residual is None else h + residual  # [N, H] the split state
    norms = torch.linalg.vector_norm(x.float(), dim=-1).cpu()  # [N]
    outliers = outlier_tokens(norms, batch.request, batch.full, state.fill.outlier_factor)
    windows, whole = lookback_windows(positions.cpu(), batch.request, outliers, state.filler.lookback,
                                      state.filler.lookback_start)  # [N, K], [N]
    unwindowed = ~(batch.full | outliers | whole)  # filled rows whose window is not in this step: run in full
    full = batch.bounded(batch.full | outliers | unwindowed)  # every full row known: the step's runs bounded
    batch.filled, batch.outliers, batch.unwindowed = ~full, outliers, unwindowed  # what the runner counts
    filled_cpu = torch.nonzero(~full).flatten()
    filled = filled_cpu.to(x.device)  # [nF]
    late = None  # each late layer's predicted input for the filled rows [nF, H] in turn (x itself first)
    if filled.numel():
        previous = None
        if state.filler.lookback:  # [1, nF, K·H] the split states of each filled row's window
            previous = window_states(x.unsqueeze(0), windows[filled_cpu].to(x.device))
        late = late_inputs_by_layer(state.filler, x[filled].unsqueeze(0), positions[filled], previous)
    out = torch.zeros_like(h)  # [N, H]
    seg = segments(full, batch.request, positions.cpu())
    rows = seg.rows.to(x.device)  # [F] the full rows
    hf, pf = h[rows], positions[rows]
    rf = None if residual is None else residual[rows]
    with batch.attend(seg, pf):
        for j, layer in enumerate(layers[s:]):
            predicted = None if late is None else next(late)  # [nF, H]
            if layer_kind(layer) == "attention":
                if predicted is not None:
                    write_filled_kv(layer, state.late[j], predicted, positions[filled], batch, filled)
                if rows.numel():
                    hf, rf = layer(positions=pf, hidden_states=hf, residual=rf)
            else:  # linear: the mixer runs over every row of the step, so its recurrent and conv states see them all
                hf, rf = linear_layer(layer, x, hf, rf, rows, filled, predicted)
    if rows.numel() == 0:
        return out
    normed = final_norm(model)(hf, rf)
    out[rows] = normed[0] if isinstance(normed, tuple) else normed
    return out


def layer_kind(layer) -> str:
    """A decoder layer's kind: `attention` (it has `self_attn`) or `linear` (a Gated DeltaNet layer)."""
    return "linear" if layer_type(layer) == "linear_attention" else "attention"


def linear_layer(layer, x: torch.Tensor, hf: torch.Tensor, rf: torch.Tensor | None, rows: torch.Tensor,
                 filled: torch.Tensor, predicted: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One late Gated DeltaNet layer (Qwen3-Next's decoder layer, its steps as vLLM's forward takes them): the
    layer's input for every row of the step (the full rows `rows`: their true input hf + rf [F, H]; the filled rows
    `filled`: their predicted input [nF, H]; any other row, i.e. padding: the split state x [N, H]) goes through its
    input norm and mixer, so the request's recurrent and conv states advance over every row in position order; the
    full rows alone keep the mixer's output and run the MLP. Returns the full rows' (hidden, residual) [F, H] each."""
    u = x.clone()  # [N, H]
    if predicted is not None:
        u[filled] = predicted.to(u.dtype)
    input_norm, post_norm = layer_norms(layer)
    normed = input_norm(u)  # [N, H]; the full rows' are replaced next
    if rf is None:
        full_in = hf
        normed[rows] = input_norm(hf)
    else:  # the fused add-norm, as the stock layer runs it: the full rows' input and residual bit for bit
        normed[rows], full_in = input_norm(hf, rf)
    mixed = mixer_rows(gdn_mixer(layer), normed, rows)  # [F, H]
    if rows.numel() == 0:  # every row of the step filled: only the states moved
        return hf, full_in
    scales = layer_scales(layer)
    if scales is not None:
        mixed = mixed * (scales[0].to(mixed.dtype)[0] + 1)
    hf, rf = post_norm(mixed, full_in)
    hf = layer_mlp(layer)(hf)
    if scales is not None:
        hf = hf * (scales[1].to(hf.dtype)[0] + 1)
    return hf, rf


def mixer_rows(attn, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet mixer over every row of the step (hidden [N, H], its state caches updated by all of them),
    its output [F, H] for `rows` only. On a CPU the output gate's norm and out_proj run for those rows alone
    (vLLM 0.32's forward_cpu, split before its output projection); elsewhere vLLM's own forward runs over every
    row and the rows are taken from its output."""
    if not gdn_split_forward(attn):
        return attn(hidden)[rows]
    mixed_qkv, z, b, a = gdn_core_inputs(attn, hidden)  # [N, q + k + v], [N, Hv, Dv], [N, Hv], [N, Hv]
    core = gdn_core(attn, mixed_qkv, b, a)  # [N, Hv, Dv]
    if rows.numel() == 0:
        return hidden[:0]
    return gdn_output(attn, core[rows], z[rows])


def local_heads(per_head: torch.Tensor, attn) -> torch.Tensor:
    """The entries of a per-KV-head tensor [total KV heads] that this tensor-parallel rank holds: heads
    rank·local.. when the heads are split, head rank // replicas when each is replicated on several ranks."""
    layout = kv_layout(attn)
    total, size, local = layout.total_kv_heads, get_tensor_model_parallel_world_size(), layout.kv_heads
    start = (get_tensor_model_parallel_rank() // max(1, size // total)) * local
    return per_head[start : start + local].contiguous()


def write_filled_kv(layer, kv: LateKV, u: torch.Tensor, positions: torch.Tensor, batch, filled: torch.Tensor) -> None:
    """Write the K/V of the filled rows (predicted layer input u [nF, H] at `positions` [nF]) into `layer`'s cache,
    computed by the engine's projection (layer_kv)."""
    attn = self_attention(layer)
    cos, sin = rope_at(rotary(attn), positions, kv.stack.weight.dtype)  # [nF, Dr] each
    k, v = layer_kv(kv.stack, u, cos, sin, kv.key_scale)  # [nF, local KV heads, D] each
    batch.write_kv(paged_attention(attn), k.contiguous(), v.contiguous(), filled)


class RidgeFillLlamaForCausalLM(RidgeFillMixin, LlamaForCausalLM):
    """vLLM's Llama with the filled forward."""


class RidgeFillQwen2ForCausalLM(RidgeFillMixin, Qwen2ForCausalLM):
    """vLLM's Qwen2 with the filled forward."""


class RidgeFillQwen3ForCausalLM(RidgeFillMixin, Qwen3ForCausalLM):
    """vLLM's Qwen3 with the filled forward."""


class RidgeFillQwen3NextForCausalLM(RidgeFillMixin, Qwen3NextForCausalLM):
    """Qwen3-Next: Gated DeltaNet layers between gated full-attention layers, MoE MLPs (docs/hybrid.md)."""
