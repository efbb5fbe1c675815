"""`make demo`: the main job on the embedded model, end to end in a few minutes on 2 CPU cores.

1. calibrate SmolLM2-135M on ~60k tokens of wiki-leads (split 18), 2. fit ridge maps (λ by held-out error),
3. teacher-forced NLL on the last 256 tokens of 2k-token Shakespeare passages for exact prefill,
identity fill and ridge fill (the filled rows are never scored; the tail attends to their caches).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ridgefill.artifacts import load_artifact
from ridgefill.console import progress_bar, table
from ridgefill.data import documents_for, load_corpus, passages
from ridgefill.engine import FillPlan, IdentityFiller
from ridgefill.evals.nll import tail_nll
from ridgefill.paths import write_json
from ridgefill.session import open_session

MODEL, SPLIT, TAIL, LENGTH, PASSAGES = "smollm2-135m", 18, 256, 2048, 6
CAL_TOKENS, CAL_SEQ = 61440, 1024


def run_demo(out_dir: Path) -> dict:
    from ridgefill.workflows import calibrate_command, fit_command

    started = time.perf_counter()
    stats, maps = out_dir / "stats.safetensors", out_dir / f"maps-s{SPLIT}.safetensors"
    if not _reusable(stats):
        calibrate_command(MODEL, "wiki-leads", str(SPLIT), CAL_TOKENS, CAL_SEQ, stats, True, 0.1, 1, 20.0, 8,
                          "fp32", "cpu", 2048)
    fit = fit_command(stats, maps, SPLIT, "auto", "ridge", None)
    session = open_session(MODEL)
    keep = (0,)
    variants = {
        "exact": None,
        "identity": FillPlan(IdentityFiller(SPLIT, session.engine.n_layers), TAIL, keep),
        "ridge": session.fill_plan(str(maps), SPLIT, TAIL, keep)[0],
    }
    docs = documents_for(load_corpus("shakespeare"), "evaluation")
    texts = passages(session.tokenizer, docs, LENGTH, PASSAGES)
    nll = {k: [] for k in variants}
    with progress_bar("scoring Shakespeare passages", len(texts) * len(variants)) as advance:
        for ids in texts:
            for name, plan in variants.items():
                nll[name].append(float(tail_nll(session.engine, torch.tensor([ids]), TAIL, plan).mean()))
                advance()
    means = {k: sum(v) / len(v) for k, v in nll.items()}
    rows = [[k, means[k], means[k] - means["exact"], 100 * (means[k] / means["exact"] - 1)] for k in variants]
    table(f"tail NLL (last {TAIL} of {LENGTH} tokens, {len(texts)} passages, split {SPLIT})",
          ["variant", "mean NLL (nats)", "Δ vs exact", "Δ %"], rows)
    result = {
        "command": "demo", "model": session.loaded.info(), "maps": {"path": str(maps), "split": SPLIT},
        "config": {"tail": TAIL, "length": LENGTH, "passages": len(texts), "keep_rows": list(keep),
                   "calibration_tokens": CAL_TOKENS, "seq_len": CAL_SEQ},
        "variants": list(variants), "heldout_error": {"identity": fit["mean_error_identity"],
                                                      "ridge": fit["mean_error_map"]},
        "results": {k: {"score": means[k], "per_passage": nll[k]} for k in variants},
        "duration_s": time.perf_counter() - started,
    }
    write_json(out_dir / "demo.json", result)
    return result


def _reusable(stats: Path) -> bool:
    """A finished statistics file from an earlier demo run is reused."""
    if not stats.exists():
        return False
    _, meta = load_artifact(stats, "stats")
    return meta.get("tokens") == CAL_TOKENS and meta.get("splits") == [SPLIT]
