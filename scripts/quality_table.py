"""Markdown tables for docs/quality.md from `ruler` and `loss` result documents.

    python scripts/quality_table.py splits RUN_DIR
        one row per split of a run folder (its artifacts ruler-sS-* and loss-sS-*, the newest of each split; so
        several recipes may share the folder): RULER filled-region score of
        exact and each fill's difference, distant-token NLL of exact and each fill's gap, the key tokens, the
        share of identity's gap that ridge keeps; intervals as the commands computed them.

    python scripts/quality_table.py controls RUN_DIR
        one row per split of a run folder, every fill variant its documents hold (identity, ridge and the null
        controls drop and mean): RULER filled-region score of each and its difference to exact, and each one's
        distant-token NLL gap to exact, with the intervals the commands computed.

    python scripts/quality_table.py compare BASE_RULER BASE_LOSS NAME=RULER,LOSS ...
        each variant's ridge against the base's ridge on the same samples: its own numbers, and the paired
        difference variant − base (RULER points, distant-token and tail NLL nats) with a 95 % bootstrap
        interval over samples / passages. The documents must come from the same samples (same tasks, lengths,
        seed; same passages).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ridgefill.runtime.stats import paired_bootstrap


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def cell(interval: dict | None, spec: str = "+.3g") -> str:
    if not interval:
        return "–"
    return f"{interval['estimate']:{spec}} [{interval['low']:{spec}}, {interval['high']:{spec}}]"


def per_split(run_dir: Path) -> str:
    found = newest(run_dir)
    head = ("| split | RULER exact | identity − exact | ridge − exact | distant NLL exact | identity − exact | "
            "ridge − exact | key tokens (passages) | ridge keeps of identity's gap | tail NLL: identity − exact | "
            "ridge − exact |")
    lines = [head, "|" + "---|" * 11]
    for split in sorted(found):
        r, lo = found[split].get("ruler"), found[split].get("loss")
        ruler = ["–"] * 3
        if r:
            ruler = [f"{r['results']['exact']['score']:.1f}", cell(r["intervals"]["identity"]["score"], "+.1f"),
                     cell(r["intervals"]["ridge"]["score"], "+.1f")]
        if lo:
            spread = lo["distant_spread"]
            kept = lo["intervals"]["ridge"].get("identity_gap_kept_distant")
            nll = [f"{lo['results']['exact']['distant_nll']:.3f}", cell(lo["intervals"]["identity"]["distant_nll_nats"]),
                   cell(lo["intervals"]["ridge"]["distant_nll_nats"]),
                   f"{spread['tokens']} ({spread['passages_with_tokens']}/{spread['passages']})",
                   cell({k: 100 * kept[k] for k in ("estimate", "low", "high")}, ".0f") + " %" if kept else "–",
                   cell(lo["intervals"]["identity"]["tail_nll_nats"]), cell(lo["intervals"]["ridge"]["tail_nll_nats"])]
        else:
            nll = ["–"] * 7
        lines.append(f"| {split} | " + " | ".join(ruler + nll) + " |")
    return "\n".join(lines)


FILLS = ("identity", "drop", "mean", "ridge")


def newest(run_dir: Path) -> dict[int, dict]:
    """split -> {"ruler": doc, "loss": doc}: each step's newest artifact of that split in a run folder."""
    found: dict[int, dict] = {}
    for step in ("ruler", "loss"):
        for path in sorted((run_dir / "artifacts").glob(f"{step}-s*-*.json"), key=lambda p: p.stat().st_mtime):
            split = int(path.name.split("-")[1][1:])
            found.setdefault(split, {})[step] = load(path)  # the newest last
    return found


def controls(run_dir: Path) -> str:
    found = newest(run_dir)
    present = [v for v in FILLS if any(v in d.get(step, {}).get("results", {}) for d in found.values()
                                       for step in ("ruler", "loss"))]
    head = ("| split | RULER exact | " + " | ".join(f"{v} (− exact)" for v in present) + " | distant NLL exact | "
            + " | ".join(f"{v} − exact" for v in present) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(present))]
    for split in sorted(found):
        r, lo = found[split].get("ruler"), found[split].get("loss")
        row = [f"{r['results']['exact']['score']:.1f}" if r else "–"]
        for v in present:
            if r and v in r["results"]:
                row.append(f"{r['results'][v]['score']:.1f} ({cell(r['intervals'][v]['score'], '+.1f')})")
            else:
                row.append("–")
        row.append(f"{lo['results']['exact']['distant_nll']:.3f}" if lo else "–")
        row += [cell(lo["intervals"][v]["distant_nll_nats"]) if lo and v in lo["results"] else "–" for v in present]
        lines.append(f"| {split} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ruler_scores(doc: dict, variant: str = "ridge") -> tuple[list, list[float]]:
    keys = [(s["task"], s["length"], s["index"]) for s in doc["samples"]]
    return keys, [s["scores"][variant] for s in doc["samples"]]


def loss_sums(doc: dict, variant: str = "ridge") -> dict[str, list[float]]:
    p = doc["results"][variant]["per_passage"]
    tail = doc["results"][variant]["tail_tokens"] / len(p["tail_nll_sum"])
    return {"distant": p["distant_nll_sum"], "tokens": p["distant_tokens"],
            "tail": [x / tail for x in p["tail_nll_sum"]]}


def compare(base_ruler: str, base_loss: str, variants: list[str]) -> str:
    br, bl = load(base_ruler), load(base_loss)
    keys, base_scores = ruler_scores(br)
    base_sums = loss_sums(bl)
    lines = ["| maps | RULER ridge | − plain ridge (points) | distant NLL ridge − exact | − plain ridge (nats) | "
             "tail NLL − plain ridge (nats) |", "|" + "---|" * 6,
             f"| plain ridge | {br['results']['ridge']['score']:.1f} | – | "
             f"{cell(bl['intervals']['ridge']['distant_nll_nats'])} | – | – |"]
    for spec in variants:
        name, files = spec.split("=", 1)
        r_path, l_path = files.split(",")
        r, lo = load(r_path), load(l_path)
        r_keys, scores = ruler_scores(r)
        if r_keys != keys:
            raise SystemExit(f"{r_path}: other RULER samples than {base_ruler}")
        sums = loss_sums(lo)
        if sums["tokens"] != base_sums["tokens"]:
            raise SystemExit(f"{l_path}: other passages (distant-token counts differ) than {base_loss}")
        d_ruler = paired_bootstrap({"a": scores, "b": base_scores}, lambda m: m["a"] - m["b"])
        d_distant = paired_bootstrap({"a": sums["distant"], "b": base_sums["distant"], "n": sums["tokens"]},
                                     lambda m: (m["a"] - m["b"]) / m["n"])
        d_tail = paired_bootstrap({"a": sums["tail"], "b": base_sums["tail"]}, lambda m: m["a"] - m["b"])
        lines.append(f"| {name} | {r['results']['ridge']['score']:.1f} | {cell(d_ruler.to_dict(), '+.1f')} | "
                     f"{cell(lo['intervals']['ridge']['distant_nll_nats'])} | {cell(d_distant.to_dict())} | "
                     f"{cell(d_tail.to_dict())} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "splits":
        print(per_split(Path(argv[1])))
    elif len(argv) >= 2 and argv[0] == "controls":
        print(controls(Path(argv[1])))
    elif len(argv) >= 4 and argv[0] == "compare":
        print(compare(argv[1], argv[2], argv[3:]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
