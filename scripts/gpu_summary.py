"""scripts/gpu_check.sh's small helpers and its summary table.

    python scripts/gpu_summary.py RESULTS [--out summary.md]   # the summary of a results folder (Markdown)
    python scripts/gpu_summary.py --env env.json               # versions and the device, as JSON
    python scripts/gpu_summary.py --maps-meta MAPS fit.json    # a maps file's metadata (fit's held-out errors)

The summary reads what the check wrote: steps.jsonl (each step's exit code and time), tests.xml (pytest's JUnit),
projection.json, attention.json, ttft.json / ttft-long.json (bench-ttft exact / identity / ridge against
transformers' forward), window.json, chunk-*.json and fit.json; a missing file is a missing section."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

GIB = 2**30


def env(out: Path) -> None:
    import torch

    from ridgefill.runtime.provenance import device_info, versions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = {"versions": {**versions(), "torch_cuda": torch.version.cuda}, "device": device_info(device)}
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


def maps_meta(maps: Path, out: Path) -> None:
    from ridgefill.runtime.artifacts import read_meta

    doc = read_meta(maps, "maps")
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"maps {maps}: kind {doc.get('kind')}, split {doc.get('split')}, {len(doc.get('layers') or [])} layers")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def table(head: list[str], rows: list[list]) -> list[str]:
    cells = [[c if isinstance(c, str) else _fmt(c) for c in row] for row in rows]
    return [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}", *(f"| {' | '.join(r)} |" for r in cells), ""]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def ms(timing: dict | None) -> float | None:
    return None if timing is None else 1000 * timing["median_s"]


def gib(timing: dict | None) -> float | None:
    peak = None if timing is None else timing.get("peak_memory_bytes")
    return None if peak is None else peak / GIB


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def steps_section(results: Path) -> list[str]:
    path = results / "steps.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return ["## Steps", *table(["step", "exit", "seconds"],
                               [[r["step"], exit_cell(r), r["ms"] / 1000] for r in rows])]


def exit_cell(step: dict) -> str:
    if step.get("skipped"):
        return f"not run ({step['skipped']})"
    return "ok" if step["rc"] == 0 else f"**{step['rc']}**"


def tests_section(results: Path) -> list[str]:
    try:
        root = ET.parse(results / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return []
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    lines = ["## tests/gpu", f"{counts['tests']} tests: {counts['failures']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped", ""]
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                message = (bad.get("message") or "").splitlines()[0][:200]
                lines.append(f"- {kind}: {case.get('name')}: {message}")
    return lines + [""]


def projection_section(results: Path) -> list[str]:
    doc = load(results / "projection.json")
    if doc is None:
        return []
    s = doc["shape"]
    rows = [[r["variant"], r["route"], r["k_max_rel"], r["k_rms_rel"], r["v_max_rel"], r["v_rms_rel"], r["norm_kv_ms"],
             r["fill_ms"]] for r in doc["results"]]
    auto = next((r["auto_route"] for r in doc["results"] if "auto_route" in r), None)
    return [f"## Fill projection ({s['late_layers']} layers, {s['rows']:,} rows, H {s['hidden']:,}, {s['kv_heads']} KV "
            f"heads of {s['head_dim']}, bf16; errors against float32; auto picks {auto})",
            *table(["variant", "route", "K max rel", "K RMS rel", "V max rel", "V RMS rel", "norm+K/V ms", "fill ms"],
                   rows)]


def attention_section(results: Path) -> list[str]:
    """scripts/attention_check.py's JSON: the routes it ran by default, and each list of flat records in it (one
    table per list, its scalar fields as columns)."""
    doc = load(results / "attention.json")
    if not isinstance(doc, dict):
        return []
    lines = ["## Attention routes", f"default routes: {doc.get('routes')}", ""]
    for name, rows in doc.items():
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            head = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
            lines += [f"{name}:", "", *table(head, [[r.get(k) for k in head] for r in rows])]
    return lines


def ttft_rows(doc: dict) -> list[list]:
    rows = []
    for e in doc["results"]:
        t, fill = e["timings"], e["fill"]
        hf, exact = ms(t.get("transformers")), ms(t.get("exact"))
        for name in fill:
            f = fill[name]
            rows.append([e["length"], name, hf, exact, ms(t[name]), ratio(exact, hf), f["speedup"], f["limit_speedup"],
                         percent(f["achieved_over_limit"]), ratio(hf, ms(t[name])), gib(t.get("transformers")),
                         gib(t.get("exact")), gib(t[name])])
    return rows


TTFT_HEAD = ["tokens", "fill", "transformers ms", "exact ms", "fill ms", "exact / transformers (time)",
             "fill speedup vs exact", "FLOP limit", "of limit", "fill speedup vs transformers", "transformers GiB",
             "exact GiB", "fill GiB"]


def ttft_section(results: Path) -> list[str]:
    rows, title = [], None
    for name in ("ttft", "ttft-long", "window"):
        doc = load(results / f"{name}.json")
        if doc is None:
            continue
        c = doc["config"]
        title = title or (f"{doc['model']['id']}, {c['dtype']} on {doc['device'].get('gpu', doc['device']['device'])}, "
                          f"split {doc['split']}, tail {c['tail']}")
        window = f" W={doc['filled_window']['size']}" if doc.get("filled_window") else ""
        rows += [[r[0], f"{r[1]}{window} ({c['repeats']}x after {c.get('warmup', '?')} warm-up, chunk {c['chunk']})", *r[2:]] for r in ttft_rows(doc)]
    if not rows:
        return []
    return [f"## Time to first token ({title})", *table(TTFT_HEAD, rows)]


def chunk_section(results: Path) -> list[str]:
    """The chunk sweep's points, and the ttft step's at the sweep's length (the chunk it ran with is not rerun)."""
    docs = [d for d in map(load, results.glob("chunk-*.json")) if d is not None]
    if not docs:
        return []
    lengths = {e["length"] for d in docs for e in d["results"]}
    main = load(results / "ttft.json")
    if main is not None and main["config"]["chunk"] not in {d["config"]["chunk"] for d in docs}:
        docs.append({**main, "results": [e for e in main["results"] if e["length"] in lengths]})
    rows = []
    for doc in sorted(docs, key=lambda d: d["config"]["chunk"]):
        for e in doc["results"]:
            t = e["timings"]
            rows.append([doc["config"]["chunk"], e["length"], ms(t.get("transformers")), ms(t.get("exact")),
                         ms(t.get("identity")), ratio(ms(t.get("exact")), ms(t.get("transformers"))),
                         gib(t.get("transformers")), gib(t.get("exact"))])
    return ["## Chunk sweep (exact)", *table(["chunk", "tokens", "transformers ms", "exact ms", "identity ms",
                                              "exact / transformers (time)", "transformers GiB", "exact GiB"], rows)]


def fit_section(results: Path) -> list[str]:
    doc = load(results / "fit.json")
    if doc is None:
        return []
    layers = doc.get("layers") or []
    mean = {k: sum(layer[k] for layer in layers) / len(layers) if layers else None
            for k in ("error_map", "error_identity")}
    return ["## calibrate + fit", f"maps kind {doc.get('kind')}, split {doc.get('split')}, {len(layers)} layers, mean "
            f"{doc.get('errors_on')} error: ridge {_fmt(mean['error_map'])}, identity {_fmt(mean['error_identity'])} "
            "(random weights: the numbers mean nothing; the check is that calibrate and fit run)", ""]


def summary(results: Path) -> str:
    e = load(results / "env.json") or {}
    v, d = e.get("versions", {}), e.get("device", {})
    lines = ["# GPU check", f"device: {d.get('name')} ({d.get('kind')}); torch {v.get('torch')} (CUDA "
             f"{v.get('torch_cuda')}), triton {v.get('triton')}, transformers {v.get('transformers')}, python "
             f"{v.get('python')}", ""]
    for section in (steps_section, tests_section, projection_section, attention_section, ttft_section,
                    chunk_section, fit_section):
        lines += section(results)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", type=Path, help="the check's results folder")
    ap.add_argument("--out", type=Path, help="write the summary here too")
    ap.add_argument("--env", type=Path, metavar="OUT", help="write versions and the device to OUT")
    ap.add_argument("--maps-meta", nargs=2, type=Path, metavar=("MAPS", "OUT"), help="a maps file's metadata")
    a = ap.parse_args()
    if a.env:
        return env(a.env)
    if a.maps_meta:
        return maps_meta(*a.maps_meta)
    text = summary(a.results)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
