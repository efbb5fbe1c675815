"""The private vLLM state the plugin reads and the vLLM internals it calls, in one place, checked at start-up (vLLM
imported only when called).

`READS` is the table: each entry names a vLLM class (or module), what the plugin reads or calls there, why, and the
functions below that do it (`by`). Every read of vLLM's internals by the plugin's code goes through one of these
functions (no other module of backends/vllm/plugin/ reads a private vLLM attribute itself). `check_reads` (run by the plugin
when it registers, before any patch is applied) checks each entry against the installed vLLM (backends/vllm/plugin/surface.py:
a Read's fields and attributes, a Call's parameter names): a vLLM that renamed, dropped or re-signed one fails
start-up with one line naming it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.plugin.surface import Call, Read

GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
RUNNER = "vllm.v1.worker.gpu_model_runner"
MODELS = "vllm.model_executor.models"
ATTENTION = ("qkv_proj", "q_size", "kv_size", "head_dim", "total_num_kv_heads", "rotary_emb", "attn")
DECODER = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
FAMILIES = (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("qwen3_next", "Qwen3Next"))
# the keyword arguments full_rows_metadata builds the full rows' attention metadata with
METADATA_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
                   "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping",
                   "causal", "positions")


READS = (
    Read("vllm.v1.attention.backend", "CommonAttentionMetadata", METADATA_FIELDS,
         "the full rows' attention metadata", ("full_rows_metadata",)),
    Call("vllm.v1.worker.utils", "AttentionGroup", "get_metadata_builder", ("self", "ubatch_id"),
         "the builder of a group's attention metadata", ("full_rows_metadata",)),
    Call("vllm.v1.attention.backend", "AttentionMetadataBuilder", "build",
         ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
         "builds the full rows' attention metadata (every backend's builder)", ("full_rows_metadata",)),
    Read(CPU_ATTN, "CPUAttentionMetadata", ("block_table",),
         "the step's block table, indexed for the full rows", ("block_table",)),
    Read("vllm.forward_context", None, ("get_forward_context",), "the step's forward context",
         ("step_metadata", "set_step_metadata")),
    Read("vllm.forward_context", "ForwardContext", ("attn_metadata", "slot_mapping"),
         "swapped for the full rows' while the late layers run", ("step_metadata", "set_step_metadata")),
    Read("vllm.v1.worker.utils", "AttentionGroup", ("layer_names", "kv_cache_spec"),
         "each attention group's layers, attention or Gated DeltaNet", ("group_layers", "is_attention")),
    Read("vllm.v1.kv_cache_interface", None, ("AttentionSpec",), "attention groups, not Gated DeltaNet ones",
         ("is_attention",)),
    Read("vllm.model_executor.layers.attention.attention", "Attention", ("layer_name", "kv_cache", "impl"),
         "writes the filled rows' K/V into a layer's paged cache", ("layer_name", "write_layer_kv")),
    Call(CPU_ATTN, "CPUAttentionBackendImpl", "do_kv_cache_update",
         ("self", "layer", "key", "value", "kv_cache", "slot_mapping"), "the backend's own cache write",
         ("write_layer_kv",)),
    Read(RUNNER, "GPUModelRunner", ("input_batch", "query_start_loc", "requests", "attn_groups", "vllm_config"),
         "the step's requests, token offsets, attention groups and configuration",
         ("prompt_progress", "step_requests", "request_params", "live_requests", "attention_groups",
          "runner_config")),
    Call(RUNNER, "GPUModelRunner", "get_model", ("self",), "the model, and its fill state", ("runner_model",)),
    Read("vllm.v1.worker.gpu_input_batch", "InputBatch",
         ("num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens", "req_ids"),
         "each request's prompt length and progress", ("prompt_progress", "step_requests")),
    Read("vllm.v1.utils", "CpuGpuBuffer", ("np",), "the step's token offsets (the runner's query_start_loc)",
         ("step_requests",)),
    Read("vllm.v1.worker.gpu_input_batch", "CachedRequestState", ("sampling_params",),
         "a running request's options", ("request_params",)),
    Read("vllm.v1.engine", "EngineCoreRequest", ("prompt_token_ids", "prompt_embeds", "sampling_params",
                                                 "cache_salt"),
         "a new request's prompt, options and salt", ("prompt_length", "sampling_params", "cache_salt",
                                                     "set_cache_salt")),
    Read("vllm.v1.request", "Request", ("num_prompt_tokens", "sampling_params"), "a cache hit's request",
         ("prompt_tokens", "sampling_params")),
    Read("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", ("blocks",), "a cache hit cut before the tail",
         ("block_lists", "cache_blocks")),
    *(Read(f"{MODELS}.{module}", f"{family}Model", ("layers", "norm"), "the decoder stack and its final norm",
           ("decoder_layers", "final_norm")) for module, family in FAMILIES),
    *(Call(f"{MODELS}.{module}", f"{family}Model", "embed_input_ids", ("self", "input_ids"),
           "the token embeddings of a filled step", ("embed",)) for module, family in FAMILIES),
    *(Read(f"{MODELS}.{module}", f"{family}DecoderLayer", DECODER, "a decoder layer's attention, norms and MLP",
           ("self_attention", "layer_norms", "layer_mlp")) for module, family in FAMILIES),
    *(Read(f"{MODELS}.{module}", f"{family}Attention", ATTENTION + extra,
           "an attention layer's K/V rows of its qkv_proj, k-norm, RoPE and paged attention",
           ("kv_layout", "rotary", "paged_attention")) for (module, family), extra in
      zip(FAMILIES, ((), (), ("k_norm",), ("k_norm", "attn_output_gate")))),
    Read("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", ("cos_sin_cache", "is_neox_style"),
         "the RoPE tables the filled keys are rotated with", ("rope_table",)),
    *(Read("vllm.model_executor.layers.layernorm", norm, ("weight", "variance_epsilon"),
           "the input norm and k-norm the filled K/V go through", ("norm_params",))
      for norm in ("RMSNorm", "GemmaRMSNorm")),
    Read("vllm.model_executor.models.qwen3_next", "Qwen3NextDecoderLayer",
         ("layer_type", "linear_attn", "layer_scale", "attn_layer_scale", "ffn_layer_scale"),
         "a hybrid's decoder layer: its kind, its Gated DeltaNet mixer and its scales",
         ("layer_type", "gdn_mixer", "layer_scales")),
    Read(GDN, "QwenGatedDeltaNetAttention", ("_forward_method", "gqa_interleaved_layout"),
         "whether a Gated DeltaNet mixer runs vLLM's CPU forward, which the plugin splits", ("gdn_split_forward",)),
    Read(GDN, "QwenGatedDeltaNetAttention", ("in_proj_qkvz", "in_proj_ba"),
         "a Gated DeltaNet mixer's input projections", ("gdn_core_inputs",)),
    Call(GDN, "QwenGatedDeltaNetAttention", "fix_query_key_value_ordering", ("self", "mixed_qkvz", "mixed_ba"),
         "splits a Gated DeltaNet mixer's projected input", ("gdn_core_inputs",)),
    Read(GDN, "QwenGatedDeltaNetAttention", ("num_v_heads", "tp_size", "head_v_dim", "prefix"),
         "the shape of a Gated DeltaNet mixer's core output, and its layer name", ("gdn_core",)),
    Call("vllm.utils.torch_utils", None, "_encode_layer_name", ("layer_name",),
         "the layer name vLLM's CPU Gated DeltaNet kernel takes", ("gdn_core",)),
    Call(CPU_GDN, None, "cpu_gdn_attention_core", ("mixed_qkv", "b", "a", "core_attn_out", "layer_name"),
         "vLLM's CPU Gated DeltaNet kernel (torch.ops.vllm.cpu_gdn_attention_core), over every row",
         ("gdn_core",)),
    Call(GDN, "QwenGatedDeltaNetAttention", "_output_projection", ("self", "core_attn_out", "z"),
         "a Gated DeltaNet mixer's gated norm and output projection, for the full rows only", ("gdn_output",)),
    Call("vllm.model_executor.layers.utils", None, "dispatch_cpu_unquantized_gemm", ("layer", "remove_weight"),
         "runs the maps as vLLM runs a linear layer on a CPU (its `cpu_linear`)", ("cpu_gemm",)),
    Read("vllm.entrypoints.serve.engine.serving", "BaseServing", ("model_config", "create_error_response"),
         "a serving handler's model and its 400 (detokenize's ids checked)", ("vocab_size", "bad_request")),
    Call("vllm.config.model", "ModelConfig", "get_vocab_size", ("self",), "the model's vocabulary size",
         ("vocab_size",)),
)


def check_reads(reads=READS) -> None:
    """Raise a one-line RidgefillError naming the first entry of `reads` the installed vLLM does not match."""
    seen: dict = {}  # class -> the names its methods assign, shared by the entries (surface.assigned)
    for read in reads:
        problem = read.problem(seen)
        if problem:
            raise RidgefillError(problem)


# The model runner and its step.


def prompt_progress(runner):
    """(computed, prompt) of the runner's step: numpy arrays over its R requests, tokens computed before the step
    and prompt lengths."""
    batch = runner.input_batch
    n = batch.num_reqs
    return batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n]


def step_requests(runner):
    """(req_ids [R], query_start [R + 1] token offsets, numpy) of the runner's step."""
    n = runner.input_batch.num_reqs
    return list(runner.input_batch.req_ids[:n]), runner.query_start_loc.np[: n + 1]


def request_params(runner, req_id: str):
    """The sampling parameters of the runner's request `req_id` (None: not a sampling request, or not running)."""
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def live_requests(runner):
    """The ids of the runner's requests not finished (a mapping keyed by id)."""
    return runner.requests


def attention_groups(runner) -> list:
    """The runner's attention groups, every KV cache group's in turn."""
    return [group for groups in runner.attn_groups for group in groups]


def runner_config(runner):
    """The runner's VllmConfig."""
    return runner.vllm_config


def vocab_size(serving) -> int:
    """The vocabulary size of the model a serving handler (the API server's) serves."""
    return serving.model_config.get_vocab_size()


def bad_request(serving, message: str):
    """vLLM's 400 ErrorResponse saying `message`."""
    return serving.create_error_response(message)


def runner_model(runner):
    return runner.get_model()


# Attention: the step's metadata and the paged cache.


def step_metadata():
    """(attention metadata, slot mappings) of the step under way, each a dict by layer name."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    return ctx.attn_metadata, ctx.slot_mapping


def set_step_metadata(metadata: dict, slots: dict) -> None:
    """Make the attention layers that run next see `metadata` and `slots` (dicts by layer name)."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    ctx.attn_metadata, ctx.slot_mapping = metadata, slots


def block_table(metadata):
    """The block table [R, blocks] of an attention layer's metadata for the step."""
    return metadata.block_table


def group_layers(group) -> list[str]:
    """The names of an attention group's layers."""
    return group.layer_names


def is_attention(group) -> bool:
    """An attention group of attention layers (not Gated DeltaNet ones)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(group.kv_cache_spec, AttentionSpec)


def full_rows_metadata(group, seg, base, slots, positions):
    """The attention metadata of the full rows `seg` for one attention group, built by the group's own builder from
    the step's metadata `base` (its block table) and the rows' `slots` and `positions`."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    table = block_table(base)
    device = table.device
    common = CommonAttentionMetadata(
        query_start_loc=seg.query_start.to(device), query_start_loc_cpu=seg.query_start,
        seq_lens=seg.seq_lens.to(device), seq_lens_cpu_upper_bound=seg.seq_lens, num_reqs=seg.n,
        num_actual_tokens=int(seg.rows.numel()), max_query_len=seg.max_query_len,
        max_seq_len=int(seg.seq_lens.max()), block_table_tensor=table[seg.request.to(device)],
        slot_mapping=slots, causal=True, positions=positions)
    return group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common)


def layer_name(attn) -> str:
    """The name an attention layer's metadata and slots are keyed by."""
    return attn.layer_name


def write_layer_kv(attn, key, value, slots) -> None:
    """key, value [n, kv_heads, head_dim] -> the paged cache of attention layer `attn` at `slots` [n], through the
    backend's own cache write."""
    attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slots)


# Requests and the prefix cache (the engine core).


def sampling_params(request):
    """A request's sampling parameters (None: not a sampling request)."""
    return request.sampling_params


def prompt_length(request) -> int:
    """The prompt length of a new request (EngineCoreRequest): its token ids, or its prompt embeddings' rows."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return int(request.prompt_embeds.shape[0])


def cache_salt(request) -> str | None:
    return request.cache_salt


def set_cache_salt(request, salt: str) -> None:
    request.cache_salt = salt


def prompt_tokens(request) -> int:
    """The prompt length of a scheduled request (vLLM's Request)."""
    return request.num_prompt_tokens


def block_lists(blocks) -> tuple:
    """A cache hit's blocks: one list of blocks per KV cache group."""
    return blocks.blocks


def cache_blocks(blocks: tuple):
    """vLLM's KVCacheBlocks of `blocks` (one tuple of blocks per KV cache group)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(blocks)


# The model: its decoder layers, their attention, norms and RoPE.


def decoder_layers(model):
    """A vLLM causal LM's decoder stack (its `model`)'s layers."""
    return model.layers


def final_norm(model):
    return model.norm


def embed(model, input_ids):
    """The token embeddings [N, H] of `input_ids` [N]."""
    return model.embed_input_ids(input_ids)


def self_attention(layer):
    """A decoder layer's attention module (vLLM's LlamaAttention, Qwen2Attention, ...)."""
    return layer.self_attn


def layer_norms(layer):
    """(input norm, post-attention norm) of a decoder layer."""
    return layer.input_layernorm, layer.post_attention_layernorm


def layer_mlp(layer):
    return layer.mlp


class KVLayout(NamedTuple):
    """Where an attention layer's K and V rows sit in its (tensor-parallel shard of) qkv_proj, and its k-norm."""

    qkv_weight: object  # [rows, H] the qkv_proj weight
    qkv_bias: object  # [rows] or None
    k_rows: slice
    v_rows: slice
    head_dim: int
    kv_heads: int  # this rank's KV heads
    total_kv_heads: int
    k_norm: object  # the k-norm module, or None (Llama, Qwen2)


def kv_layout(attn) -> KVLayout:
    """The KVLayout of attention module `attn`: its qkv_proj's rows are the queries (and, in Qwen3-Next, their
    output gate), then K, then V."""
    qkv, kv = attn.qkv_proj, attn.kv_size
    q_rows = attn.q_size * (2 if getattr(attn, "attn_output_gate", False) else 1)
    return KVLayout(qkv.weight, getattr(qkv, "bias", None), slice(q_rows, q_rows + kv),
                    slice(q_rows + kv, q_rows + 2 * kv), attn.head_dim, kv // attn.head_dim,
                    attn.total_num_kv_heads, getattr(attn, "k_norm", None))


def rotary(attn):
    """An attention module's rotary embedding."""
    return attn.rotary_emb


def rope_table(rotary_emb):
    """(cos_sin_cache [positions, Dr], NeoX style) of a rotary embedding: a row holds the cos, then the sin, of its
    Dr/2 frequencies."""
    return rotary_emb.cos_sin_cache, rotary_emb.is_neox_style


def norm_params(norm):
    """(weight, epsilon) of a vLLM RMSNorm (GemmaRMSNorm: the zero-centred weight, as stored)."""
    return norm.weight, norm.variance_epsilon


def paged_attention(attn):
    """An attention module's paged attention layer (vLLM's Attention), whose cache the filled K/V are written to."""
    return attn.attn


# A hybrid's decoder layers and their Gated DeltaNet mixers (Qwen3-Next).


def layer_type(layer) -> str:
    """A decoder layer's type: `linear_attention` (a Gated DeltaNet layer) or `full_attention` (also every layer of
    a dense model, which has no type)."""
    return getattr(layer, "layer_type", "full_attention")


def gdn_mixer(layer):
    """A Gated DeltaNet layer's mixer (vLLM's QwenGatedDeltaNetAttention)."""
    return layer.linear_attn


def layer_scales(layer):
    """(attention, MLP) output scales [1, ...] of a hybrid decoder layer that scales them, else None."""
    if not getattr(layer, "layer_scale", False):
        return None
    return layer.attn_layer_scale, layer.ffn_layer_scale


def gdn_split_forward(attn) -> bool:
    """Whether a Gated DeltaNet mixer runs vLLM's CPU forward on Qwen3-Next's interleaved layout, the one
    mixer_rows splits before its output projection (else vLLM's own forward runs whole)."""
    return attn._forward_method.__name__ == "forward_cpu" and attn.gqa_interleaved_layout is not False


def gdn_core_inputs(attn, hidden):
    """The core inputs of a Gated DeltaNet mixer over `hidden` [N, H], as vLLM 0.32's forward_cpu derives them:
    (mixed_qkv [N, q + k + v], z [N, Hv, Dv], b [N, Hv], a [N, Hv]) for this rank's heads."""
    import torch
    from einops import rearrange

    mixed_qkvz, _ = attn.in_proj_qkvz(hidden)
    ba, _ = attn.in_proj_ba(hidden)
    query, key, value, z, b, a = attn.fix_query_key_value_ordering(mixed_qkvz, ba)
    query, key, value = (rearrange(t, "l p d -> l (p d)") for t in (query, key, value))
    return torch.cat((query, key, value), dim=-1), z, b, a


def gdn_core(attn, mixed_qkv, b, a):
    """vLLM's CPU Gated DeltaNet kernel over every row of the step (the layer's recurrent and conv states advance
    over all of them): the core output [N, Hv, Dv]."""
    import torch
    from vllm.utils.torch_utils import _encode_layer_name

    core = torch.zeros((mixed_qkv.size(0), attn.num_v_heads // attn.tp_size, attn.head_v_dim),
                       dtype=mixed_qkv.dtype, device=mixed_qkv.device)  # [N, Hv, Dv]
    torch.ops.vllm.cpu_gdn_attention_core(mixed_qkv, b, a, core, _encode_layer_name(attn.prefix))
    return core


def gdn_output(attn, core, z):
    """A Gated DeltaNet mixer's output [n, H] from its core output [n, Hv, Dv] and gate z [n, Hv, Dv]: its gated
    norm and output projection."""
    return attn._output_projection(core, z)


# Linear layers on a CPU.


def cpu_gemm(weight, bias) -> Callable:
    """x [N, in] -> x·weightᵀ + bias through vLLM's CPU GEMM dispatch (oneDNN or its packed kernels, the weight
    prepacked once), as vLLM runs its own linear layers on a CPU."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    holder.bias = None if bias is None else torch.nn.Parameter(bias.contiguous(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return lambda x: holder.cpu_linear(x, holder.weight, holder.bias)
