"""RidgeFill's counters as a server publishes them: the one tally (torchfill/fill_plan.FillTally) counted by the
serving engine and written to its /metrics by prometheus_client under the tally's own names
(ridgefill_<field>_total). vLLM's plugin publishes them through vLLM's multiprocess /metrics (registry None: the
PROMETHEUS_MULTIPROC_DIR files vLLM's /metrics reads), llama.cpp's server through a registry of its own. No engine
import.

| counter | counts |
|---|---|
| `ridgefill_filled_tokens_total` | prompt tokens filled: their late layers' K/V written from the maps |
| `ridgefill_full_tokens_total` | prompt tokens run through every layer (tail, kept first tokens, short prompts, and the rows below) |
| `ridgefill_cached_prompt_tokens_total` | prompt tokens served from the server's prefix cache (not computed) |
| `ridgefill_outlier_tokens_total` | tokens the rule fills that ran in full: their split state is an outlier |
| `ridgefill_lookback_full_tokens_total` | tokens the rule fills that ran in full: their lookback window is not in the step |
| `ridgefill_run_bound_full_tokens_total` | tokens the rule fills that ran in full: their step had more runs of full tokens than max_num_seqs |
| `ridgefill_recomputed_prompt_tokens_total` | prompt tokens computed again after the server preempted their request (counted once already) |
| `ridgefill_stock_steps_total` | steps that ran stock (exact) because their fill could not be planned |
"""

from __future__ import annotations

import threading
from dataclasses import fields

from ridgefill.torchfill.fill_plan import FillTally

HELP = {
    "filled_tokens": "Prompt tokens RidgeFill filled (late layers' K/V from the maps)",
    "full_tokens": "Prompt tokens run through every layer",
    "cached_prompt_tokens": "Prompt tokens served from the server's prefix cache (neither filled nor run: each prompt "
                            "token is counted once, in filled, full or cached)",
    "recomputed_prompt_tokens": "Prompt tokens computed again after the server preempted their request (not counted "
                                "again in filled, full or cached)",
    "outlier_tokens": "Tokens the fill rule fills that ran in full: split-state outliers",
    "lookback_full_tokens": "Tokens the fill rule fills that ran in full: their lookback window was not in the step",
    "run_bound_full_tokens": "Tokens the fill rule fills that ran in full: their step had more runs of full tokens "
                             "than the attention backend's metadata holds (max_num_seqs)",
    "stock_steps": "Steps run stock (exact) because their fill could not be planned",
}
PREFIX = "ridgefill_"
MARKER = f"{PREFIX}filled_tokens_total"  # on /metrics only where RidgeFill runs in the server


class FillCounters:
    """A server's FillTally, counted from any thread, with the tally's `kept` fields (default: all) published as
    Prometheus counters when `publish` (in `registry`; None: prometheus_client's multiprocess files)."""

    def __init__(self, publish: bool = False, registry=None, kept: tuple[str, ...] | None = None) -> None:
        self.kept = kept or tuple(f.name for f in fields(FillTally))
        self.totals = dict.fromkeys(self.kept, 0)
        self.lock = threading.Lock()
        self.registry, self.prometheus = registry, {}
        if publish:
            from prometheus_client import Counter

            self.prometheus = {k: Counter(PREFIX + k, HELP[k], registry=registry) for k in self.kept}

    def count(self, **added: int) -> None:
        with self.lock:
            for key, n in added.items():
                self.totals[key] += n
                if n and key in self.prometheus:
                    self.prometheus[key].inc(n)

    def tally(self) -> FillTally:
        with self.lock:
            return FillTally(**self.totals)

    def to_dict(self) -> dict:
        return self.tally().to_dict()
