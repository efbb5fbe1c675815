"""What every command does first: load the model and build its engine, quietly."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from ridgefill.engine import Engine, FillPlan
from ridgefill.errors import RidgefillError
from ridgefill.method.maps import load_filler
from ridgefill.runtime.models import DTYPES, LoadedModel, load_model


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def check_device(device: str, dtype: str) -> None:
    if device not in ("cpu", "cuda"):
        raise RidgefillError(f"unknown device '{device}': use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise RidgefillError("--device cuda but no CUDA GPU is visible: use --device cpu")
    if dtype not in DTYPES:
        raise RidgefillError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    if device == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise RidgefillError("this GPU cannot run bf16: use --dtype fp16 or fp32")


@dataclass
class Session:
    loaded: LoadedModel
    engine: Engine

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def fill_plan(self, maps: str, split: int | None, tail: int, keep_rows=()) -> tuple[FillPlan, dict]:
        a = self.engine.adapter
        filler, meta = load_filler(maps, self.loaded.info(), split, a.dtype, a.device)
        return FillPlan(filler, tail, tuple(keep_rows)), meta


def open_session(model: str, dtype: str = "fp32", device: str = "cpu", chunk: int = 2048) -> Session:
    quiet_libraries()
    check_device(device, dtype)
    if chunk < 1:
        raise RidgefillError(f"--chunk must be at least 1, got {chunk}")
    loaded = load_model(model, dtype, device)
    return Session(loaded, Engine(loaded.adapter, chunk=chunk))


def parse_splits(text: str, n_layers: int) -> list[int]:
    try:
        splits = sorted({int(s) for s in str(text).split(",") if s.strip()})
    except ValueError:
        raise RidgefillError(f"--split '{text}' is not a comma-separated list of integers") from None
    bad = [s for s in splits if not 1 <= s < n_layers]
    if not splits or bad:
        raise RidgefillError(f"split {bad or text} is out of range: use 1..{n_layers - 1} for this "
                             f"{n_layers}-layer model")
    return splits


VARIANTS = ("exact", "identity", "ridge")


def parse_variants(text, maps) -> list[str]:
    """--variants: comma-separated names (or a list). Default: every variant, ridge only with --maps.
    Exact always runs, first: every difference is taken against it."""
    if text is None:
        return [v for v in VARIANTS if v != "ridge" or maps is not None]
    names = [v.strip() for v in (text.split(",") if isinstance(text, str) else text) if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        raise RidgefillError(f"--variants '{text}' names unknown variant(s) {unknown}: use {', '.join(VARIANTS)}")
    if "ridge" in names and maps is None:
        raise RidgefillError("the ridge variant needs --maps (from ridgefill fit): pass it, or drop ridge from "
                             "--variants")
    return ["exact", *[v for v in VARIANTS if v in names and v != "exact"]]


def variant_plans(session: Session, maps: str | None, split: int | None, tail: int, keep_rows=(),
                  variants=VARIANTS) -> tuple[dict[str, FillPlan | None], dict | None]:
    """The plans measured side by side: exact (None), identity fill and the fitted maps, at one split and tail.
    Returns (plans, maps metadata). Without --maps only exact and identity (which then needs --split) run."""
    from ridgefill.engine import IdentityFiller

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise RidgefillError(f"unknown variant(s) {unknown}: use {', '.join(VARIANTS)}")
    meta = None
    plans: dict[str, FillPlan | None] = {}
    if "ridge" in variants:
        if maps is None:
            raise RidgefillError("the ridge variant needs --maps (from ridgefill fit)")
        plans_ridge, meta = session.fill_plan(maps, split, tail, keep_rows)
        split = meta["split"]
    n_layers = session.engine.n_layers
    if split is None and "identity" in variants:
        raise RidgefillError("pass --split (or --maps, which carries it)")
    if split is not None and not 1 <= split <= n_layers:
        raise RidgefillError(f"split {split} is out of range: use 1..{n_layers} for this model")
    for v in variants:
        if v == "exact":
            plans[v] = None
        elif v == "identity":
            plans[v] = FillPlan(IdentityFiller(split, n_layers), tail, tuple(keep_rows))
        else:
            plans[v] = plans_ridge
    return plans, meta
