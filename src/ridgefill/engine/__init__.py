"""The fill engine: every command runs a model through `Engine` and a family `Adapter`."""

from ridgefill.engine.adapters import Adapter, adapter_for, supported_families
from ridgefill.engine.cache import AttentionCache, Cache, StateCache
from ridgefill.engine.fillers import Filler, IdentityFiller, MapFiller, OracleFiller
from ridgefill.engine.hybrid import HybridAdapter
from ridgefill.engine.prefill import Engine, FillPlan, PrefillResult

__all__ = [
    "Adapter", "adapter_for", "supported_families", "AttentionCache", "Cache", "StateCache", "Filler",
    "IdentityFiller", "MapFiller", "OracleFiller", "Engine", "FillPlan", "PrefillResult", "HybridAdapter",
]
