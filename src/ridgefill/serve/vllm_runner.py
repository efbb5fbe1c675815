"""The model-runner side of the vLLM plugin: which tokens of a step are filled, attention for full rows only, and
what each step filled (counters, and a loud warning for a request that should have been filled and was not).

vLLM's model forward sees a flat batch of token ids and positions; the prompt length and sampling parameters of
each request live in the model runner. The plugin wraps the runner's `_model_forward` (the documented hook
around the model call) so that, when the model carries RidgeFill state and some token of the step is filled, it
passes a FillBatch to the model as the keyword argument `ridgefill_batch`. Every other step, and every dummy or
profiling run (which calls the model directly), runs stock. Nothing a request carries can make a step fail: the
request's options were checked at admission (serve/vllm_admission.py) and are clamped to its prompt here, and a
step whose fill cannot be planned runs stock, is counted (`stock_steps`) and logged.

FillBatch gives the model two things the stock layers cannot do:
- `write_kv(attn, k, v, rows)`: write K/V of some rows into one attention layer's paged cache (the backend's own
  cache update, with those rows' slots);
- `attend(segments, positions)`: for the late layers, swap the step's attention metadata and slot mappings for
  ones that describe only the full rows (built by each attention group's own metadata builder, with the block
  tables of the step's metadata), so that stock layer code runs attention for those rows over every cached key.
  A hybrid model's Gated DeltaNet layers keep the step's own metadata: their mixer runs over every row.
The model reports back which rows it filled (`FillBatch.filled`, `.outliers`, `.unwindowed`).

Only V1's model runner is hooked: the plugin makes vLLM use it (serve/vllm_plugin.py) and refuses to start where
vLLM would still pick Model Runner V2, whose runner calls the model itself.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ridgefill.serve.vllm_requests import request_rule
from ridgefill.serve.vllm_rows import Segments, full_tokens, token_requests

log = logging.getLogger("ridgefill.vllm")
HOOKED = "_ridgefill_hooked"


@dataclass
class FillBatch:
    full: torch.Tensor  # [N] bool, CPU: tokens that run the full model (before outlier rows are added)
    request: torch.Tensor  # [N] long, CPU: each token's request index in the step (-1: padding)
    groups: list  # the runner's attention groups (layer names + metadata builder each)
    # set by the model: [N] bool, CPU, the rows it filled, and those it ran in full instead (outliers, rows without
    # a whole lookback window)
    filled: torch.Tensor | None = None
    outliers: torch.Tensor | None = None
    unwindowed: torch.Tensor | None = None
    step_slots: dict | None = None  # the step's own slot mappings, while `attend` has swapped them

    def write_kv(self, attn, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor) -> None:
        """key, value [n, kv_heads, head_dim] of the batch rows `rows` [n] -> attention layer `attn`'s cache (also
        within `attend`: the rows index the step's batch)."""
        from vllm.forward_context import get_forward_context

        slots = (self.step_slots or get_forward_context().slot_mapping)[attn.layer_name][rows]
        attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slots)

    @contextmanager
    def attend(self, seg: Segments, positions: torch.Tensor):
        """Within: attention layers see a batch of only the full rows `seg.rows` (at `positions` [F])."""
        from vllm.forward_context import get_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.kv_cache_interface import AttentionSpec

        ctx = get_forward_context()
        stock_meta, stock_slots = ctx.attn_metadata, ctx.slot_mapping
        if seg.n == 0:  # no full row: no attention layer runs (linear layers keep the step's own metadata)
            yield
            return
        meta, slots = dict(stock_meta), dict(stock_slots)
        for group in self.groups:
            if not isinstance(group.kv_cache_spec, AttentionSpec):  # Gated DeltaNet layers run over every row
                continue
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
        ctx.attn_metadata, ctx.slot_mapping, self.step_slots = meta, slots, stock_slots
        try:
            yield
        finally:
            ctx.attn_metadata, ctx.slot_mapping, self.step_slots = stock_meta, stock_slots, None


@dataclass
class Step:
    """The prompt tokens of one step, by request (what the fill rule says of them, before the model runs)."""

    req_ids: list[str]  # [R] the step's requests
    prompt: torch.Tensor  # [R] prompt lengths
    tails: list[int]  # [R] each request's tail (its own, or the served one), clamped to its prompt
    keeps: list[int]  # [R] each request's keep-first, likewise
    request: torch.Tensor  # [N] each token's request index (-1: padding)
    in_prompt: torch.Tensor  # [N] bool: prompt tokens (decode tokens are not)
    last: torch.Tensor  # [N] bool: a request's last prompt token
    full: torch.Tensor  # [N] bool: the rule's full tokens

    def batch(self, runner) -> FillBatch | None:
        """The FillBatch to pass to the model, or None when the rule fills no token of this step."""
        if bool(self.full.all()):
            return None
        return FillBatch(self.full, self.request, [g for groups in runner.attn_groups for g in groups])


@dataclass
class Seen:
    """What the steps so far did to one request's prompt: rows the rule fills, and rows filled."""

    rule: int = 0
    filled: int = 0


@dataclass
class StepLog:
    """Per model: requests whose prefill is under way (by request id), and the warnings already given."""

    requests: dict[str, Seen] = field(default_factory=dict)
    warned_stock: int = 0


def plan_step(runner, positions: torch.Tensor, served_tail: int, served_keep: int) -> Step | None:
    """The step the runner is about to run, or None when it holds no prompt token (decode only)."""
    batch = runner.input_batch
    n_reqs = batch.num_reqs
    if not (batch.num_computed_tokens_cpu[:n_reqs] < batch.num_prompt_tokens[:n_reqs]).any():
        return None  # every request has its prompt computed: a decode step (numpy over [R], no tensor work)
    query_start = torch.from_numpy(runner.query_start_loc.np[: n_reqs + 1].astype("int64"))
    request = token_requests(query_start, positions.shape[0])
    prompt = torch.from_numpy(batch.num_prompt_tokens[:n_reqs].astype("int64"))
    positions = positions.cpu().long()
    real = request >= 0
    in_prompt = real & (positions < prompt[request.clamp(min=0)])
    if not bool(in_prompt.any()):
        return None
    req_ids = list(batch.req_ids[:n_reqs])
    tails, keeps = [], []
    for i, req_id in enumerate(req_ids):
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        tail, keep = request_rule(params, int(prompt[i]), served_tail, served_keep)
        tails.append(tail)
        keeps.append(keep)
    full = full_tokens(positions, request, prompt, torch.tensor(tails, dtype=torch.long),
                       torch.tensor(keeps, dtype=torch.long))
    last = in_prompt & (positions == prompt[request.clamp(min=0)] - 1)
    return Step(req_ids, prompt, tails, keeps, request, in_prompt, last, full)


def account(state, step: Step, batch: FillBatch | None, book: StepLog) -> None:
    """Count what the step did (state.count: the tally and vLLM's /metrics counters), and warn loudly for each
    request whose prompt ended in this step with rows the rule fills and none filled."""
    filled = batch.filled if batch is not None and batch.filled is not None else torch.zeros_like(step.full)
    outliers = batch.outliers if batch is not None and batch.outliers is not None else torch.zeros_like(step.full)
    unwindowed = (batch.unwindowed if batch is not None and batch.unwindowed is not None
                  else torch.zeros_like(step.full))
    state.count(filled=int(filled.sum()), full=int((step.in_prompt & ~filled).sum()), outliers=int(outliers.sum()),
                unwindowed=int(unwindowed.sum()))
    n = len(step.req_ids)
    mine = step.request.clamp(min=0)
    rule = torch.bincount(mine[step.in_prompt & ~step.full], minlength=n)  # [R]
    got = torch.bincount(mine[filled], minlength=n)  # [R]
    prefilling = set(step.request[step.in_prompt].tolist())
    ended = set(step.request[step.last].tolist())
    for i, req_id in enumerate(step.req_ids):
        if i not in prefilling:  # decode tokens only
            continue
        seen = book.requests.setdefault(req_id, Seen())
        seen.rule += int(rule[i])
        seen.filled += int(got[i])
        if i in ended:
            del book.requests[req_id]
            if seen.rule > 0 and seen.filled == 0:
                log.warning("ridgefill: request %s (%d prompt tokens, tail %d, keep-first %d) filled none of its "
                            "%d fillable tokens: it was served exact, without RidgeFill's speed-up (its filled-region "
                            "rows were all outliers or without a lookback window)", req_id, int(step.prompt[i]),
                            step.tails[i], step.keeps[i], seen.rule)
    if len(book.requests) > 4 * n + 256:  # requests aborted mid-prefill never end here: forget them
        live = set(step.req_ids)
        for req_id in [r for r in book.requests if r not in live]:
            del book.requests[req_id]


def install_runner_hook() -> None:
    """Wrap V1's GPUModelRunner._model_forward (the CPU runner inherits it) once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, HOOKED, False):
        return
    stock = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        state = getattr(self.get_model(), "ridgefill", None)
        step = batch = None
        if state is not None and positions is not None:
            try:
                step = plan_step(self, positions, state.fill.tail, state.fill.keep_first)
                batch = None if step is None else step.batch(self)
            except Exception as exc:  # never fatal: the step runs stock (exact), counted and logged
                step = batch = None
                _stock_step(state, exc)
        if batch is not None:
            model_kwargs["ridgefill_batch"] = batch
        out = stock(self, input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                    inputs_embeds=inputs_embeds, **model_kwargs)
        if step is not None:
            account(state, step, batch, state.log)
        return out

    GPUModelRunner._model_forward = _model_forward
    setattr(GPUModelRunner, HOOKED, True)


def _stock_step(state, exc: Exception) -> None:
    state.count(stock_steps=1)
    state.log.warned_stock += 1
    if state.log.warned_stock in (1, 10, 100, 1000) or state.log.warned_stock % 10000 == 0:
        log.warning("ridgefill: a step ran stock (exact, not filled) because its fill could not be planned "
                    "(%s: %s); %d such steps so far (ridgefill_stock_steps_total)", type(exc).__name__, exc,
                    state.log.warned_stock)
