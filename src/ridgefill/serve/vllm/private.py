"""The private vLLM state the plugin reads, in one place, checked at start-up (vLLM imported only when called).

`READS` lists every class (or module) whose private fields or attributes the plugin reads and why; `check_reads`
(run by the plugin when it registers, before any patch is applied) checks that each of them still exists in the
installed vLLM: a dataclass's or msgspec struct's fields, a class's attributes (defined on it, or assigned by its
methods: `self.x = ...`), a module's functions. A vLLM that renamed or dropped one fails start-up with one line
naming what is missing. The accessors below are how the plugin's runner and prefix-cache code reach that state.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import inspect
import types
from typing import NamedTuple

from ridgefill.errors import RidgefillError
from ridgefill.serve.vllm_config import VLLM_PIN

GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
# the keyword arguments FillBatch.attend builds the full rows' attention metadata with
METADATA_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
                   "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping",
                   "causal", "positions")


class Read(NamedTuple):
    module: str
    owner: str | None  # the class read; None: `names` are the module's own
    names: tuple[str, ...]
    why: str


READS = (
    Read("vllm.v1.attention.backend", "CommonAttentionMetadata", METADATA_FIELDS,
         "the full rows' attention metadata (FillBatch.attend)"),
    Read("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata", ("block_table",),
         "the step's block table, indexed for the full rows (FillBatch.attend)"),
    Read("vllm.forward_context", "ForwardContext", ("attn_metadata", "slot_mapping"),
         "swapped for the full rows' while the late layers run (FillBatch.attend, write_kv)"),
    Read("vllm.v1.worker.utils", "AttentionGroup", ("layer_names", "kv_cache_spec", "get_metadata_builder"),
         "each attention group's layers and metadata builder (FillBatch.attend)"),
    Read("vllm.v1.kv_cache_interface", None, ("AttentionSpec",), "attention groups, not Gated DeltaNet ones"),
    Read("vllm.model_executor.layers.attention.attention", "Attention", ("layer_name", "kv_cache", "impl"),
         "writes the filled rows' K/V into a layer's paged cache (FillBatch.write_kv)"),
    Read("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", ("do_kv_cache_update",),
         "the backend's own cache write (FillBatch.write_kv)"),
    Read("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
         ("input_batch", "query_start_loc", "requests", "attn_groups", "vllm_config", "get_model"),
         "the step's requests, token offsets and attention groups (plan_step, model_forward)"),
    Read("vllm.v1.worker.gpu_input_batch", "InputBatch",
         ("num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens", "req_ids"),
         "each request's prompt length and progress (plan_step)"),
    Read("vllm.v1.engine", "EngineCoreRequest", ("prompt_token_ids", "prompt_embeds", "sampling_params",
                                                 "cache_salt"), "a new request's prompt, options and salt"),
    Read("vllm.v1.request", "Request", ("num_prompt_tokens", "sampling_params"), "a cache hit's request"),
    Read("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", ("blocks",), "a cache hit cut before the tail"),
    Read(GDN, "QwenGatedDeltaNetAttention",
         ("_forward_method", "gqa_interleaved_layout", "in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering",
          "num_v_heads", "tp_size", "head_v_dim", "prefix", "_output_projection"),
         "a Gated DeltaNet mixer run over every row, its output kept for the full rows (model.mixer_rows)"),
    Read(GDN, None, ("_encode_layer_name",), "the layer name vLLM's CPU Gated DeltaNet kernel takes"),
)


def check_reads(reads=READS) -> None:
    """Raise a one-line RidgefillError naming the first read whose class or fields the installed vLLM lacks."""
    for read in reads:
        missing = [n for n in read.names if n not in available(read)]
        if missing:
            where = f"{read.module}.{read.owner}" if read.owner else read.module
            raise RidgefillError(f"vLLM's {where} has no {', '.join(missing)}, which ridgefill's vLLM plugin reads "
                                 f"({read.why}); this vLLM is not the release it was written for: {VLLM_PIN}")


def available(read: Read) -> set[str]:
    """The names `read` may use: the module's attributes, or its class's fields and attributes."""
    try:
        module = importlib.import_module(read.module)
    except ImportError:
        return set()
    if read.owner is None:
        return set(vars(module))
    owner = getattr(module, read.owner, None)
    if not isinstance(owner, type):
        return set()
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    return fields | set(getattr(owner, "__struct_fields__", ())) | set(dir(owner)) | assigned(owner)


def assigned(cls: type) -> set[str]:
    """The attribute names the methods of `cls` (and its bases) assign (`self.x = ...`)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            function = inspect.unwrap(getattr(value, "__func__", getattr(value, "fget", value)) or value)
            if isinstance(function, types.FunctionType):
                names |= _stored(function.__code__)
    return names


def _stored(code: types.CodeType) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored(const)
    return names


def forward_context():
    from vllm.forward_context import get_forward_context

    return get_forward_context()


def cache_blocks(blocks: tuple):
    """vLLM's KVCacheBlocks of `blocks` (one tuple of blocks per KV cache group)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(blocks)


def is_attention(group) -> bool:
    """An attention group of attention layers (not Gated DeltaNet ones)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(group.kv_cache_spec, AttentionSpec)


def full_rows_metadata(group, seg, base, slots, positions):
    """The attention metadata of the full rows `seg` for one attention group, built by the group's own builder from
    the step's metadata `base` (its block table) and the rows' `slots` and `positions`."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device = base.block_table.device
    common = CommonAttentionMetadata(
        query_start_loc=seg.query_start.to(device), query_start_loc_cpu=seg.query_start,
        seq_lens=seg.seq_lens.to(device), seq_lens_cpu_upper_bound=seg.seq_lens, num_reqs=seg.n,
        num_actual_tokens=int(seg.rows.numel()), max_query_len=seg.max_query_len,
        max_seq_len=int(seg.seq_lens.max()), block_table_tensor=base.block_table[seg.request.to(device)],
        slot_mapping=slots, causal=True, positions=positions)
    return group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common)


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
