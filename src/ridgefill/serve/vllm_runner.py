"""The model-runner side of the vLLM plugin: which tokens of a step are filled, and attention for full rows only.

vLLM's model forward sees a flat batch of token ids and positions; the prompt length and sampling parameters of
each request live in the model runner. The plugin wraps the runner's `_model_forward` (the documented hook
around the model call) so that, when the model carries RidgeFill state and some token of the step is filled, it
passes a FillBatch to the model as the keyword argument `ridgefill_batch`. Every other step, and every dummy or
profiling run (which calls the model directly), runs stock.

FillBatch gives the model two things the stock layers cannot do:
- `write_kv(attn, k, v, rows)`: write K/V of some rows into one attention layer's paged cache (the backend's own
  cache update, with those rows' slots);
- `attend(segments, positions)`: for the late layers, swap the step's attention metadata and slot mappings for
  ones that describe only the full rows (built by each attention group's own metadata builder, with the block
  tables of the step's metadata), so that stock layer code runs attention for those rows over every cached key.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ridgefill.serve.vllm_config import TAIL_ARG
from ridgefill.serve.vllm_rows import Segments, full_tokens, token_requests

log = logging.getLogger("ridgefill.vllm")
KEEP_FIRST_ARG = "ridgefill_keep_first"
HOOKED = "_ridgefill_hooked"


@dataclass
class FillBatch:
    full: torch.Tensor  # [N] bool, CPU: tokens that run the full model (before outlier rows are added)
    request: torch.Tensor  # [N] long, CPU: each token's request index in the step (-1: padding)
    groups: list  # the runner's attention groups (layer names + metadata builder each)

    def write_kv(self, attn, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor) -> None:
        """key, value [n, kv_heads, head_dim] of the batch rows `rows` [n] -> attention layer `attn`'s cache."""
        from vllm.forward_context import get_forward_context

        slots = get_forward_context().slot_mapping[attn.layer_name][rows]
        attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slots)

    @contextmanager
    def attend(self, seg: Segments, positions: torch.Tensor):
        """Within: attention layers see a batch of only the full rows `seg.rows` (at `positions` [F])."""
        from vllm.forward_context import get_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        ctx = get_forward_context()
        stock_meta, stock_slots = ctx.attn_metadata, ctx.slot_mapping
        if not isinstance(stock_meta, dict) or not isinstance(stock_slots, dict):
            raise RuntimeError("ridgefill: micro-batched steps are not supported (disable ubatching/DBO)")
        meta, slots = dict(stock_meta), dict(stock_slots)
        for group in self.groups:
            names = [n for n in group.layer_names if n in stock_meta]
            if not names:
                continue
            base = stock_meta[names[0]]
            device = base.block_table.device
            rows = seg.rows.to(device)
            common = CommonAttentionMetadata(
                query_start_loc=seg.query_start.to(device), query_start_loc_cpu=seg.query_start,
                seq_lens=seg.seq_lens.to(device), seq_lens_cpu_upper_bound=seg.seq_lens, num_reqs=seg.n,
                num_actual_tokens=int(seg.rows.numel()), max_query_len=seg.max_query_len,
                max_seq_len=int(seg.seq_lens.max()), block_table_tensor=base.block_table[seg.request.to(device)],
                slot_mapping=stock_slots[names[0]][rows], causal=True, positions=positions)
            built = group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common)
            for name in names:
                meta[name], slots[name] = built, stock_slots[name][rows]
        ctx.attn_metadata, ctx.slot_mapping = meta, slots
        try:
            yield
        finally:
            ctx.attn_metadata, ctx.slot_mapping = stock_meta, stock_slots


def request_rule(params, prompt_len: int, tail: int, keep_first: int) -> tuple[int, int]:
    """(tail, keep_first) of one request: its extra_args override the served defaults; a request that asks for
    prompt log-probs (which need every prompt row's final hidden state) or is not a sampling request runs exact."""
    if params is None or getattr(params, "prompt_logprobs", None) is not None:
        return prompt_len, keep_first
    extra = getattr(params, "extra_args", None) or {}
    return _positive(extra, TAIL_ARG, tail, 1), _positive(extra, KEEP_FIRST_ARG, keep_first, 0)


def _positive(extra: dict, key: str, default: int, least: int) -> int:
    if key not in extra:
        return default
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        log.warning("ridgefill: ignoring %s=%r (an integer >= %d is needed); using %d", key, value, least, default)
        return default
    return value


def fill_batch(runner, positions: torch.Tensor) -> FillBatch | None:
    """The FillBatch of the step the runner is about to run, or None when it fills no token."""
    state = getattr(runner.get_model(), "ridgefill", None)
    if state is None or positions is None:
        return None
    batch = runner.input_batch
    n_reqs = batch.num_reqs
    query_start = torch.from_numpy(runner.query_start_loc.np[: n_reqs + 1].astype("int64"))
    request = token_requests(query_start, positions.shape[0])
    prompt = torch.from_numpy(batch.num_prompt_tokens[:n_reqs].astype("int64"))
    positions = positions.cpu()
    real = request >= 0
    if bool((positions[real] >= prompt[request[real]]).all()):  # only generated tokens (decode): all full
        return None
    tails, keeps = [], []
    for i, req_id in enumerate(batch.req_ids[:n_reqs]):
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        tail, keep = request_rule(params, int(prompt[i]), state.fill.tail, state.fill.keep_first)
        tails.append(tail)
        keeps.append(keep)
    full = full_tokens(positions, request, prompt, torch.tensor(tails), torch.tensor(keeps))
    if bool(full.all()):
        return None
    return FillBatch(full, request, [g for groups in runner.attn_groups for g in groups])


def install_runner_hook() -> None:
    """Wrap GPUModelRunner._model_forward (the CPU runner inherits it) once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, HOOKED, False):
        return
    stock = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        batch = fill_batch(self, positions)
        if batch is not None:
            model_kwargs["ridgefill_batch"] = batch
        return stock(self, input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                     inputs_embeds=inputs_embeds, **model_kwargs)

    GPUModelRunner._model_forward = _model_forward
    setattr(GPUModelRunner, HOOKED, True)
