"""`ridgefill report` on run folders of hand-made result documents: every section and plot, missing steps
skipped, the manifest's artifact list honoured."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgefill.cli import app
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.report import write_report

VARIANTS = ("exact", "identity", "ridge")


def interval(estimate: float, width: float = 0.1) -> dict:
    return {"estimate": estimate, "low": estimate - width, "high": estimate + width, "level": 0.95}


def common(command: str, split: int, tail: int, **config) -> dict:
    return {"command": command, "model": {"id": "tiny", "weights_hash": "abc", "family": "llama", "layers": 30},
            "maps": {"path": "maps.safetensors", "hash": "h", "split": split, "kind": "ridge"},
            "config": {"split": None, "tail": tail, **config}, "variants": list(VARIANTS), "seed": 0,
            "ridgefill_version": "0.1.0", "started_at": "2026-11-29T00:00:00+00:00", "duration_s": 1.0}


def fit_doc(split: int) -> dict:
    layers = [{"layer": l, "lam": 0.01, "error_identity": 0.1 * (l - split), "error_map": 0.03 * (l - split)}
              for l in range(split + 1, 30)]
    return {"command": "fit", "maps": "maps.safetensors", "kind": "ridge", "split": split, "rank": None,
            "model": {"id": "tiny", "weights_hash": "abc"}, "layers": layers,
            "mean_error_identity": sum(x["error_identity"] for x in layers) / len(layers),
            "mean_error_map": sum(x["error_map"] for x in layers) / len(layers)}


def ruler_doc(split: int, tail: int, scores: dict) -> dict:
    samples = [{"task": "niah_single_1", "length": n, "index": i, "depth": d, "scores": {v: scores[v] for v in VARIANTS}}
               for n in (2048, 4096) for i, d in enumerate((0.05, 0.3, 0.55, 0.9))]
    results = {v: {"score": s, "tasks": {"niah_single_1": {"score": s, "lengths": {"2048": s, "4096": s}}},
                   "lengths": {"2048": s, "4096": s}, "depths": {}} for v, s in scores.items()}
    intervals = {v: {"score": interval(scores[v] - scores["exact"], 5)} for v in ("identity", "ridge")}
    return {**common("ruler", split, tail, region="filled", lengths="2048,4096"), "results": results,
            "intervals": intervals, "samples": samples}


def loss_doc(split: int, tail: int) -> dict:
    nll = {"exact": 2.0, "identity": 2.4, "ridge": 2.1}
    results = {v: {"score": x, "distant_nll": x, "distant_ppl": 2.718 ** x, "distant_tokens": 40, "tail_nll": x / 2,
                   "tail_ppl": 2.718 ** (x / 2), "tail_tokens": 1000} for v, x in nll.items()}
    intervals = {v: {"distant_nll_nats": interval(nll[v] - 2.0, 0.05), "tail_nll_nats": interval((nll[v] - 2.0) / 2, 0.02)}
                 for v in ("identity", "ridge")}
    return {**common("loss", split, tail, context=4096, data="shakespeare"), "results": results,
            "intervals": intervals}


def splice_doc(split: int, tail: int) -> dict:
    names = ["keys@16-29", "values@16-29", "keys+values@16-29"]
    results = {"exact": {"distant_nll": 2.0, "tail_nll": 1.0, "retrieval": 90.0},
               "ridge": {"distant_nll": 2.2, "tail_nll": 1.1, "retrieval": 70.0}}
    results.update({n: {"distant_nll": 2.1, "tail_nll": 1.05, "retrieval": 80.0} for n in names})
    intervals = {n: {"gap_closed_distant": interval(0.3 + 0.3 * i), "gap_closed_tail": interval(0.2 + 0.3 * i),
                     "gap_closed_retrieval": interval(0.5)} for i, n in enumerate(names)}
    return {**common("splice", split, tail), "variants": list(results), "results": results, "intervals": intervals,
            "fill": "ridge", "split": split}


def longbench_doc(split: int, tail: int) -> dict:
    accuracy = {"exact": 32.0, "identity": 28.0, "ridge": 31.0}
    results = {v: {"score": a, "accuracy": {"overall": a, "easy": a + 5, "hard": a - 5, "short": a, "medium": a,
                                            "long": None}} for v, a in accuracy.items()}
    intervals = {v: {"overall": interval(accuracy[v] - 32.0, 3)} for v in ("identity", "ridge")}
    return {**common("longbench", split, tail, mode="loglik", questions=20), "results": results,
            "intervals": intervals}


def bench_doc(split: int, tail: int, speedup: float) -> dict:
    def entry(n: int) -> dict:
        exact = 0.001 * n
        timings = {v: {"median_s": exact / (speedup if v != "exact" else 1.0), "p90_s": exact, "min_s": exact}
                   for v in ("transformers",) + VARIANTS}
        fill = {v: {"speedup": speedup, "speedup_interval": interval(speedup), "limit_speedup": speedup + 0.5,
                    "achieved_over_limit": speedup / (speedup + 0.5)} for v in ("identity", "ridge")}
        return {"length": n, "timings": timings, "fill": fill, "headline_variant": "ridge"}

    return {**common("bench-ttft", split, tail, repeats=3, dtype="fp32", device="cpu"),
            "results": [entry(1024), entry(4096)], "intervals": {}, "split": split}


def write_docs(folder: Path, docs: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps(doc))
    return folder


def full_run(folder: Path) -> Path:
    docs = {"calibrate.safetensors.json": {"command": "calibrate", "rows": [], "splits": [15, 20]}}
    for split, drop in ((15, 12.0), (20, 3.0)):
        docs[f"fit-s{split}.safetensors.json"] = fit_doc(split)
        docs[f"ruler-s{split}.json"] = ruler_doc(split, 256, {"exact": 90.0, "identity": 90.0 - 2 * drop,
                                                              "ridge": 90.0 - drop})
        docs[f"loss-s{split}.json"] = loss_doc(split, 256)
        docs[f"bench-s{split}.json"] = bench_doc(split, 256, 1.0 + 20.0 / split)
    docs["splice-s15.json"] = splice_doc(15, 256)
    docs["longbench-s15.json"] = longbench_doc(15, 256)
    return write_docs(folder, docs)


def test_report_has_every_section_and_plot(tmp_path):
    run_dir = full_run(tmp_path / "run")
    report = write_report(run_dir).read_text()
    for heading in ("# ridgefill report", "## At a glance", "## Fit: held-out error per layer",
                    "## Distant-context NLL (loss)", "## RULER: retrieval by needle depth and length",
                    "## Splice: which cache component carries the fill's error", "## LongBench v2 accuracy",
                    "## Time to first token",
                    "## Sweep: speed–quality frontier and the useful split"):
        assert heading in report
    plots = {p.name: p.stat().st_size for p in (run_dir / "plots").iterdir()}
    assert set(plots) == {"fit.png", "loss.png", "ruler-s15-t256.png", "ruler-s20-t256.png", "splice-s15-t256-seed0.png",
                          "longbench-s15-t256-seed0.png", "ttft-s15-t256-seed0.png", "ttft-s20-t256-seed0.png",
                          "frontier.png"}
    assert all(size > 1000 for size in plots.values())
    for name in plots:
        assert f"(plots/{name})" in report
    # the known answer: ridge drops 12 points at split 15 and 3 at split 20; identity 24 and 6
    assert "- ridge, tail 256: **split 20**, 2.50x FLOP-limit, 2.00x measured" in report
    assert "| ridge | 256 | 15 | 2.833 | 2.333 | 4096 | 78 | 90 |" in report  # the frontier point of split 15
    assert "| 4096 | ridge | 4096 | 2048 | 2.00x [1.90x, 2.10x] | 2.5 | 0.8 |" in report  # TTFT table of split 20
    assert "- identity, tail 256: no split within 5 points of exact" in report
    assert "- useful split (ridge, tail 256): 20 (retrieval 87.0 vs exact 90.0" in report
    assert "| 15 | 16 | 0.01 | 0.1 | 0.03 |" in report  # per-layer held-out error of the fit


def test_tolerance_changes_the_useful_split(tmp_path):
    report = write_report(full_run(tmp_path / "run"), tolerance=12.0).read_text()
    assert "- ridge, tail 256: **split 15**" in report and "- identity, tail 256: **split 20**" in report


def test_sections_of_missing_steps_are_skipped(tmp_path):
    fit = fit_doc(18)
    fit["layers"][0]["error_map"] = None  # strict JSON stores a NaN error as null
    run_dir = write_docs(tmp_path / "run", {"fit.safetensors.json": fit, "loss.json": loss_doc(18, 256)})
    report = write_report(run_dir).read_text()
    assert "## Fit" in report and "## Distant-context NLL" in report
    for absent in ("## RULER", "## Splice", "## LongBench", "## Sweep", "## Steps"):
        assert absent not in report
    assert {p.name for p in (run_dir / "plots").iterdir()} == {"fit.png", "loss.png"}
    assert "distant-context NLL (split 18, tail 256, seed 0; 40 tokens): exact 2, identity 2.4 (+0.4 [+0.35, +0.45])" \
        in report
    assert "tail NLL (split 18, tail 256, seed 0; 1000 tokens): exact 1, identity 1.2 (+0.2 [+0.18, +0.22])" in report


def test_manifest_limits_the_report_to_its_artifacts(tmp_path):
    run_dir = full_run(tmp_path / "run")
    manifest = {"recipe": {"name": "mine"}, "status": "complete", "settings": {"tolerance": 12.0, "dtype": "fp32"},
                "device": {"kind": "cpu", "name": "x"}, "versions": {"ridgefill": "0.1.0"}, "git": None,
                "steps": [{"label": "loss-s15-t256-seed0", "step": "loss", "cached": True, "duration_s": 0.0,
                           "artifact": "loss-s15.json", "hashes": {"loss-s15.json": "0" * 16}}]}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    report = write_report(run_dir).read_text()
    assert report.startswith("# ridgefill report: mine")
    assert "## Distant-context NLL" in report and "## RULER" not in report and "## Fit" not in report
    assert "| loss-s15-t256-seed0 | cached | 0 | loss-s15.json |" in report


def test_report_command_and_empty_folder(tmp_path):
    run_dir = full_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0 and (run_dir / "report.md").stat().st_size > 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(RidgefillError, match="holds no ridgefill result documents"):
        write_report(tmp_path / "empty")


def test_a_json_file_nested_too_deeply_is_no_result_document(tmp_path):
    """A .json nested 100,000 deep beside the results is passed over like any file that is not a result."""
    run_dir = full_run(tmp_path / "run")
    (run_dir / "deep.json").write_text("[" * 100_000)
    assert "## RULER" in write_report(run_dir).read_text()
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "deep.json").write_text("[" * 100_000)
    with pytest.raises(RidgefillError, match="holds no ridgefill result documents"):
        write_report(tmp_path / "only")


def test_a_sweep_without_bench_ttft_shows_the_flop_limit_speedup(tmp_path):
    """The shapes come from the documents' `model` and the model folder's config.json (MLP width, vocabulary);
    the length is the longest measured prompt (here RULER's 4096); known answers from docs/performance.md."""
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"intermediate_size": 1536, "vocab_size": 49152}))
    model = {"id": str(folder), "weights_hash": "abc", "family": "llama", "layers": 30, "hidden_size": 576,
             "heads": 9, "kv_heads": 3, "head_dim": 64, "layer_kinds": ["attention"] * 30}
    docs = {}
    for split in (15, 18):
        docs[f"ruler-s{split}.json"] = {**ruler_doc(split, 256, {"exact": 90.0, "identity": 88.0, "ridge": 89.0}),
                                        "model": model}
        docs[f"loss-s{split}.json"] = {**loss_doc(split, 256), "model": model}
    report = write_report(write_docs(tmp_path / "run", docs)).read_text()
    assert "| identity | 256 | 15 | 1.784 | – | 4096 |" in report and "| ridge | 256 | 18 | 1.497 | – | 4096 |" in report
    assert "- ridge, tail 256: **split 15**, 1.71x FLOP-limit" in report
    (folder / "config.json").unlink()  # shapes unknown: no count, as before
    assert "| identity | 256 | 15 | – | – | – |" in write_report(tmp_path / "run").read_text()


def test_loss_and_splice_sections_show_how_distant_tokens_spread_over_passages(tmp_path):
    loss = loss_doc(15, 256)
    loss["distant_spread"] = {"tokens": 40, "passages": 4, "passages_with_tokens": 3, "per_passage_min": 0,
                              "per_passage_median": 12.5, "per_passage_max": 15, "largest_share": 0.375}
    old = loss_doc(20, 256)  # a document from before `distant_spread`: the per-passage counts give it
    for v in VARIANTS:
        old["results"][v]["per_passage"] = {"distant_tokens": [0, 40], "distant_nll_sum": [0.0, 80.0],
                                            "tail_nll_sum": [500.0, 500.0]}
    splice = splice_doc(15, 256)
    splice["results"]["exact"]["per_passage"] = {"distant_tokens": [5, 0, 7]}
    report = write_report(write_docs(tmp_path / "run", {"loss-s15.json": loss, "loss-s20.json": old,
                                                        "splice-s15.json": splice})).read_text()
    assert "passages with any (min/median/max)" in report
    assert "| 40 | 3 of 4 (0/12.5/15) |" in report
    assert "| 40 | 1 of 2 (0/20/40) |" in report
    assert "12 distant-context tokens in 2 of 3 passages (per passage min 0, median 5, max 7)." in report
