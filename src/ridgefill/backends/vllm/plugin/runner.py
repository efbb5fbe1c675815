"""The model-runner side of the vLLM plugin: which tokens of a step are filled, attention for full rows only, and
what each step filled (counters, and a loud warning for a request that should have been filled and was not).

vLLM's model forward sees a flat batch of token ids and positions; the prompt length and sampling parameters of
each request live in the model runner. The plugin wraps the runner's `_model_forward` (the documented hook
around the model call) so that, when the model carries RidgeFill state and some token of the step is filled, it
passes a FillBatch to the model as the keyword argument `ridgefill_batch`. Every other step, and every dummy or
profiling run (which calls the model directly), runs stock. Nothing a request carries can make a step fail: the
request's options were checked at admission (backends/vllm/plugin/admission.py) and are clamped to its prompt here, and a
step whose fill cannot be planned runs stock, is counted (`stock_steps`) and logged.

FillBatch gives the model two things the stock layers cannot do:
- `write_kv(attn, k, v, rows)`: write K/V of some rows into one attention layer's paged cache (the backend's own
  cache update, with those rows' slots);
- `attend(segments, positions)`: for the late layers, swap the step's attention metadata and slot mappings for
  ones that describe only the full rows (built by each attention group's own metadata builder, with the block
  tables of the step's metadata), so that stock layer code runs attention for those rows over every cached key.
  A hybrid model's Gated DeltaNet layers keep the step's own metadata: their mixer runs over every row.
The model reports back which rows it filled (`FillBatch.filled`, `.outliers`, `.unwindowed`).

`attend` builds one pseudo-request per run of full rows; vLLM's CUDA backends size some metadata buffers by
max_num_seqs (and the CUDA graph capture size), so a step's runs are bounded (`max_runs`, rows.bound_runs: beyond
the bound the shortest stretches of filled rows between two runs of one request run in full, counted as
`run_bound_full_tokens`). The bound is applied once, by the model (`FillBatch.bounded`), to every row it runs in full: the
rule's, and the outlier and lookback rows only the model can find; the plan carries the bound, not its result.

Every prompt token is counted once (`account`, in the one tally's names: backends/counters.py): filled or full when
its position is first computed, cached when the prefix cache served it; a prompt computed again after vLLM
preempted its request counts as recomputed.

Only V1's model runner is hooked: the plugin makes vLLM use it (backends/vllm/plugin/entry.py) and refuses to start where
vLLM would still pick Model Runner V2, whose runner calls the model itself.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ridgefill.backends.vllm.plugin.private import (attention_groups, block_table, full_rows_metadata, group_layers,
                                          is_attention, layer_name, live_requests, prompt_progress, request_params,
                                          runner_config, runner_model, set_step_metadata, step_metadata,
                                          step_requests, write_layer_kv)
from ridgefill.backends.vllm.requests import request_rule
from ridgefill.backends.vllm.plugin.rows import Segments, bound_runs, full_tokens, token_requests

log = logging.getLogger("ridgefill.vllm")


@dataclass
class FillBatch:
    full: torch.Tensor  # [N] bool, CPU: the rule's full tokens (before the model adds its rows and bounds the runs)
    request: torch.Tensor  # [N] long, CPU: each token's request index in the step (-1: padding)
    groups: list  # the runner's attention groups (layer names + metadata builder each)
    max_runs: int = 0  # the most runs of full rows `attend` may describe (runner.max_runs; 0: no bound)
    # set by the model: [N] bool, CPU, the rows it filled, and those it ran in full instead (outliers, rows without
    # a whole lookback window)
    filled: torch.Tensor | None = None
    outliers: torch.Tensor | None = None
    unwindowed: torch.Tensor | None = None
    promoted: torch.Tensor | None = None  # [N] bool: rows `bounded` ran in full to fit the run bound
    step_slots: dict | None = None  # the step's own slot mappings, while `attend` has swapped them

    def write_kv(self, attn, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor) -> None:
        """key, value [n, kv_heads, head_dim] of the batch rows `rows` [n] -> attention layer `attn`'s cache (also
        within `attend`: the rows index the step's batch)."""
        slots = (self.step_slots or step_metadata()[1])[layer_name(attn)][rows]
        write_layer_kv(attn, key, value, slots)

    def bounded(self, full: torch.Tensor) -> torch.Tensor:
        """full [N] bool (the model's full rows: `full` and the rows it adds, outliers and rows without a lookback
        window) with gaps closed until its runs fit `max_runs` (rows.bound_runs), for `attend`; the rows it
        closes are counted (`promoted`). The one place the run bound is applied: the model calls it once a step."""
        out = full if self.max_runs <= 0 else bound_runs(full, self.request, self.max_runs)
        self.promoted = out & ~full
        return out

    @contextmanager
    def attend(self, seg: Segments, positions: torch.Tensor):
        """Within: attention layers see a batch of only the full rows `seg.rows` (at `positions` [F])."""
        stock_meta, stock_slots = step_metadata()
        if seg.n == 0:  # no full row: no attention layer runs (linear layers keep the step's own metadata)
            yield
            return
        meta, slots = dict(stock_meta), dict(stock_slots)
        for group in self.groups:
            names = [n for n in group_layers(group) if n in stock_meta] if is_attention(group) else []
            if not names:  # Gated DeltaNet layers run over every row
                continue
            base = stock_meta[names[0]]
            rows = seg.rows.to(block_table(base).device)
            built = full_rows_metadata(group, seg, base, stock_slots[names[0]][rows], positions)
            for name in names:
                meta[name], slots[name] = built, stock_slots[name][rows]
        set_step_metadata(meta, slots)
        self.step_slots = stock_slots
        try:
            yield
        finally:
            set_step_metadata(stock_meta, stock_slots)
            self.step_slots = None


@dataclass
class Step:
    """The prompt tokens of one step, by request (what the fill rule says of them, before the model runs)."""

    req_ids: list[str]  # [R] the step's requests
    prompt: torch.Tensor  # [R] prompt lengths
    tails: list[int]  # [R] each request's tail (its own, or the served one), clamped to its prompt
    keeps: list[int]  # [R] each request's keep-first, likewise
    request: torch.Tensor  # [N] each token's request index (-1: padding)
    positions: torch.Tensor  # [N] each token's position
    in_prompt: torch.Tensor  # [N] bool: prompt tokens (decode tokens are not)
    last: torch.Tensor  # [N] bool: a request's last prompt token
    full: torch.Tensor  # [N] bool: the tokens the rule runs in full (padding too)
    max_runs: int = 0  # the run bound of the step's full tokens, applied by the model (FillBatch.bounded; 0: none)

    def batch(self, runner) -> FillBatch | None:
        """The FillBatch to pass to the model, or None when the rule fills no token of this step."""
        if bool(self.full.all()):
            return None
        return FillBatch(self.full, self.request, attention_groups(runner), self.max_runs)


@dataclass
class Seen:
    """One request's prompt over the steps so far: rows the rule fills, rows filled, and how far it is counted
    (positions below `counted` were computed, or served from the prefix cache, once already)."""

    rule: int = 0
    filled: int = 0
    counted: int = 0
    warned: bool = False


@dataclass
class StepLog:
    """Per model: the requests whose prompt was seen, by request id, until they finish (a request vLLM preempts
    recomputes its prompt later: the log keeps it from being counted twice), and the warnings already given."""

    requests: dict[str, Seen] = field(default_factory=dict)
    warned_stock: int = 0


def max_runs(runner) -> int:
    """The most runs of full tokens (pseudo-requests of `FillBatch.attend`) a step may have: vLLM's attention
    backends size per-request metadata buffers by max_num_seqs, and under CUDA graphs some by the largest capture
    size. The CPU backend has no such buffers; the bound holds there too, so it is the same everywhere."""
    config = runner_config(runner)
    limit = int(config.scheduler_config.max_num_seqs)
    compilation = config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    capture = getattr(compilation, "max_cudagraph_capture_size", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE" and capture:
        limit = min(limit, int(capture))
    return max(1, limit)


def plan_step(runner, positions: torch.Tensor, served_tail: int, served_keep: int) -> Step | None:
    """The step the runner is about to run, or None when it holds no prompt token (decode only)."""
    computed, prompt_np = prompt_progress(runner)
    if not (computed < prompt_np).any():
        return None  # every request has its prompt computed: a decode step (numpy over [R], no tensor work)
    req_ids, query_start_np = step_requests(runner)
    query_start = torch.from_numpy(query_start_np.astype("int64"))
    request = token_requests(query_start, positions.shape[0])
    prompt = torch.from_numpy(prompt_np.astype("int64"))
    positions = positions.cpu().long()
    real = request >= 0
    in_prompt = real & (positions < prompt[request.clamp(min=0)])
    if not bool(in_prompt.any()):
        return None
    tails, keeps = [], []
    for i, req_id in enumerate(req_ids):
        tail, keep = request_rule(request_params(runner, req_id), int(prompt[i]), served_tail, served_keep)
        tails.append(tail)
        keeps.append(keep)
    full = full_tokens(positions, request, prompt, torch.tensor(tails, dtype=torch.long),
                       torch.tensor(keeps, dtype=torch.long))
    last = in_prompt & (positions == prompt[request.clamp(min=0)] - 1)
    return Step(req_ids, prompt, tails, keeps, request, positions, in_prompt, last, full, max_runs(runner))


def account(state, step: Step, batch: FillBatch | None, book: StepLog, live=None) -> None:
    """Count what the step did (state.count: the tally and vLLM's /metrics counters), each prompt token once: the
    first time its position is computed or served from the prefix cache (`cached`: the positions before a request's
    first computed one); computing it again after vLLM preempted its request counts as `recomputed` only. Warn
    loudly, once, for each request whose prompt ended with rows the rule fills and none filled. live: the ids of
    the requests not finished (the runner's `requests`), to forget the others."""
    n = len(step.req_ids)
    mine = step.request.clamp(min=0)
    filled, outliers, unwindowed, bound = (_rows(batch, name, step.full)
                                           for name in ("filled", "outliers", "unwindowed", "promoted"))
    prefilling = sorted(set(step.request[step.in_prompt].tolist()))
    seen = {i: book.requests.setdefault(step.req_ids[i], Seen()) for i in prefilling}
    counted = torch.tensor([seen[i].counted if i in seen else 0 for i in range(n)], dtype=torch.long)  # [R]
    fresh = step.in_prompt & (step.positions >= counted[mine])  # [N] prompt tokens counted for the first time
    big = torch.iinfo(torch.long).max
    first = torch.full((n,), big, dtype=torch.long).scatter_reduce(0, mine[step.in_prompt],
                                                                   step.positions[step.in_prompt], "amin")
    cached = sum(max(0, int(first[i]) - seen[i].counted) for i in prefilling)
    state.count(filled_tokens=int((fresh & filled).sum()), full_tokens=int((fresh & ~filled).sum()),
                cached_prompt_tokens=cached, recomputed_prompt_tokens=int((step.in_prompt & ~fresh).sum()),
                outlier_tokens=int((fresh & outliers).sum()), lookback_full_tokens=int((fresh & unwindowed).sum()),
                run_bound_full_tokens=int((fresh & bound).sum()))
    rule = torch.bincount(mine[fresh & ~step.full], minlength=n)  # [R]
    got = torch.bincount(mine[fresh & filled], minlength=n)  # [R]
    reached = torch.zeros(n, dtype=torch.long).scatter_reduce(0, mine[step.in_prompt],
                                                             step.positions[step.in_prompt] + 1, "amax")
    ended = set(step.request[step.last].tolist())
    for i in prefilling:
        record = seen[i]
        record.rule, record.filled = record.rule + int(rule[i]), record.filled + int(got[i])
        record.counted = max(record.counted, int(reached[i]))
        if i in ended and record.rule > 0 and record.filled == 0 and not record.warned:
            record.warned = True
            log.warning("ridgefill: request %s (%d prompt tokens, tail %d, keep-first %d) filled none of its "
                        "%d fillable tokens: it was served exact, without RidgeFill's speed-up (its filled-region "
                        "rows were all outliers, without a lookback window, or over the step's bound of %d runs)",
                        step.req_ids[i], int(step.prompt[i]), step.tails[i], step.keeps[i], record.rule,
                        step.max_runs)
    _forget_finished(book, step, live)


def _rows(batch: FillBatch | None, name: str, like: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows the model reported under `name` (none when it did not fill)."""
    rows = None if batch is None else getattr(batch, name, None)
    return torch.zeros_like(like) if rows is None else rows


def _forget_finished(book: StepLog, step: Step, live) -> None:
    """Drop the records of finished requests (not `live`; without it, not in this step) once the log has grown."""
    keep = set(step.req_ids) if live is None else live
    if len(book.requests) > 2 * len(keep) + 256:
        for req_id in [r for r in book.requests if r not in keep]:
            del book.requests[req_id]


def model_forward(stock, runner, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                  **model_kwargs):
    """The runner's `_model_forward` with the fill (backends/vllm/plugin/patches.ModelForwardPatch wraps vLLM's `stock` with
    it): plan the step, pass its FillBatch to the model, count what it did."""
    state = getattr(runner_model(runner), "ridgefill", None)
    step = batch = None
    if state is not None and positions is not None:
        try:
            step = plan_step(runner, positions, state.fill.tail, state.fill.keep_first)
            batch = None if step is None else step.batch(runner)
        except Exception as exc:  # never fatal: the step runs stock (exact), counted and logged
            step = batch = None
            _stock_step(state, exc)
    if batch is not None:
        model_kwargs["ridgefill_batch"] = batch
    out = stock(runner, input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                inputs_embeds=inputs_embeds, **model_kwargs)
    if step is not None:
        account(state, step, batch, state.log, live_requests(runner))
    return out


def _stock_step(state, exc: Exception) -> None:
    state.count(stock_steps=1)
    state.log.warned_stock += 1
    if state.log.warned_stock in (1, 10, 100, 1000) or state.log.warned_stock % 10000 == 0:
        log.warning("ridgefill: a step ran stock (exact, not filled) because its fill could not be planned "
                    "(%s: %s); %d such steps so far (ridgefill_stock_steps_total)", type(exc).__name__, exc,
                    state.log.warned_stock)
