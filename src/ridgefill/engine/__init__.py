"""The fill engine: every command runs a model through `Engine` and a family `Adapter`."""

from ridgefill.engine.cache import AttentionCache, Cache, StateCache
from ridgefill.engine.families import Adapter, HybridAdapter, adapter_for, supported_families
from ridgefill.engine.fillers import (DropFiller, Filler, IdentityFiller, MapFiller, MeanFiller, OracleFiller,
                                      late_inputs_by_layer, maps_flops)
from ridgefill.engine.fill_plan import FillPlan
from ridgefill.engine.prefill import Engine, PrefillResult
from ridgefill.engine.routes import PROJECTION_KERNELS
from ridgefill.engine.shape import ModelShape
from ridgefill.engine.timing import Stopwatch
from ridgefill.engine.window import FilledWindow, parse_layers

__all__ = [
    "Adapter", "adapter_for", "supported_families", "AttentionCache", "Cache", "StateCache", "DropFiller", "Filler",
    "IdentityFiller", "MeanFiller", "MapFiller", "OracleFiller", "late_inputs_by_layer", "maps_flops", "Engine",
    "FillPlan", "PrefillResult", "HybridAdapter",
    "PROJECTION_KERNELS", "ModelShape", "Stopwatch", "FilledWindow", "parse_layers",
]
