"""What the vLLM plugin did, counted: per model, since it loaded (the tally `VllmWorker.tally()` reads), and as
Prometheus counters on vLLM's `/metrics`. Every prompt token of a request is counted exactly once, in filled, full or
cached: filled + full + cached is the prompt tokens served. Recomputation after preemption is extra work, counted
apart.

| counter | counts |
|---|---|
| `ridgefill_filled_tokens_total` | prompt tokens filled: their late layers' K/V written from the maps |
| `ridgefill_full_tokens_total` | prompt tokens run through every layer (tail, kept first tokens, short prompts, and the outlier, lookback and run-bound rows below) |
| `ridgefill_outlier_tokens_total` | tokens the rule fills that ran in full: their split state is an outlier |
| `ridgefill_lookback_full_tokens_total` | tokens the rule fills that ran in full: their lookback window is not in the step |
| `ridgefill_run_bound_full_tokens_total` | tokens the rule fills that ran in full: their step had more runs of full tokens than max_num_seqs |
| `ridgefill_stock_steps_total` | steps that ran stock (exact) because their fill could not be planned |
| `ridgefill_cached_prompt_tokens_total` | prompt tokens served from vLLM's prefix cache (not computed) |
| `ridgefill_recomputed_prompt_tokens_total` | prompt tokens computed again after vLLM preempted their request (counted once already) |

vLLM's API server and its engine core are separate processes; the counters live where the model runs. `ridgefill
serve` gives vLLM a fresh PROMETHEUS_MULTIPROC_DIR, in which prometheus_client keeps every process's values and from
which vLLM's `/metrics` reads them all (vLLM's own mode for several API servers). Only tensor-parallel rank 0
publishes (every rank sees the same rows). Without that directory the counters stay in the engine's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgefill.backends.serving import COUNTERS  # noqa: F401  (the names are the serving seam's)


@dataclass
class FillCounters:
    """Counts by COUNTERS key; published to Prometheus when `publish` (tensor-parallel rank 0)."""

    publish: bool = False
    totals: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    _prometheus: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.publish:
            from prometheus_client import Counter

            # registry=None: not in the process's default registry (vLLM's /metrics reads the multiprocess files)
            self._prometheus = {k: Counter(name, doc, registry=None) for k, (name, doc) in COUNTERS.items()}

    def count(self, **added: int) -> None:
        for key, n in added.items():
            self.totals[key] += n
            if n and key in self._prometheus:
                self._prometheus[key].inc(n)

    def to_dict(self) -> dict:
        """The tally: rows filled and run in full, as the result documents name them."""
        t = self.totals
        return {"filled_rows": t["filled"], "outlier_rows_run_full": t["outliers"],
                "lookback_rows_run_full": t["unwindowed"], "run_bound_rows_run_full": t["run_bound"],
                "full_prompt_rows": t["full"], "cached_prompt_rows": t["cached"],
                "recomputed_prompt_rows": t["recomputed"], "stock_steps": t["stock_steps"]}
