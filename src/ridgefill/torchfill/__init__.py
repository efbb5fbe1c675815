"""The fill in torch: torchfill (`Runner`, run through a family `Adapter`) and the pieces (rows, fillers,
projection, lookback) that vLLM's plugin and llama.cpp's driver reuse."""

from ridgefill.torchfill.cache import AttentionCache, Cache, StateCache
from ridgefill.torchfill.families import Adapter, HybridAdapter, adapter_for, supported_families
from ridgefill.torchfill.fillers import (DropFiller, Filler, IdentityFiller, MapFiller, MeanFiller, OracleFiller,
                                         late_inputs_by_layer, maps_flops)
from ridgefill.torchfill.fill_plan import FillPlan
from ridgefill.torchfill.prefill import Runner, PrefillResult
from ridgefill.torchfill.routes import PROJECTION_KERNELS
from ridgefill.torchfill.shape import ModelShape
from ridgefill.torchfill.timing import Stopwatch
from ridgefill.torchfill.window import FilledWindow, parse_layers

__all__ = [
    "Adapter", "adapter_for", "supported_families", "AttentionCache", "Cache", "StateCache", "DropFiller", "Filler",
    "IdentityFiller", "MeanFiller", "MapFiller", "OracleFiller", "late_inputs_by_layer", "maps_flops", "Runner",
    "FillPlan", "PrefillResult", "HybridAdapter",
    "PROJECTION_KERNELS", "ModelShape", "Stopwatch", "FilledWindow", "parse_layers",
]
