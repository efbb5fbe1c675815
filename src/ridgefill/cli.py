"""The `ridgefill` command line: thin commands that parse options, call one workflow, print a table and
write JSON. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ridgefill import __version__
from ridgefill.errors import RidgefillError

app = typer.Typer(
    help="RidgeFill: fill upper-layer caches from a ridge map of the split state, and measure the cost.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)

MODEL = typer.Option("smollm2-135m", "--model", help="Local HF folder, Hub id, or alias 'smollm2-135m'.")
DTYPE = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16.")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
CHUNK = typer.Option(2048, "--chunk", help="Prompt rows run at once (bounds activation memory).")
MAPS = typer.Option(None, "--maps", help="Maps file (needed for the ridge variant).")
SPLIT = typer.Option(None, "--split", help="Split S (checked against the maps; needed without them).")
EXACT_CACHE = typer.Option(None, "--exact-cache", help="Folder that keeps exact results by sample, so runs on the "
                           "same samples (e.g. other splits) reuse them (recipes set it in the run folder).")


def _version(value: bool):
    if value:
        print(f"ridgefill {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                              help="Print the version and exit.")):
    """Calibrate once, fit closed-form maps, then fill prefill and measure it against exact."""


@app.command()
def calibrate(
    model: str = MODEL,
    data: str = typer.Option(..., "--data", help="Text: .txt/.jsonl file or folder, Hub dataset, "
                             "or 'wiki-leads' / 'shakespeare'."),
    split: str = typer.Option(..., "--split", help="Split layer(s) S, comma-separated: one pass serves all."),
    tokens: int = typer.Option(65536, "--tokens", help="Calibration tokens (held-out share included)."),
    seq_len: int = typer.Option(1024, "--seq-len", help="Tokens per calibration sequence."),
    out: Path = typer.Option(..., "--out", help="Statistics file (.safetensors) to write."),
    resume: bool = typer.Option(False, "--resume", help="Continue from <out>.partial after an interruption."),
    holdout: float = typer.Option(0.1, "--holdout", help="Share of sequences kept for validation (0..0.5)."),
    skip_first: int = typer.Option(1, "--skip-first", help="Leading rows of each sequence kept out (sinks)."),
    outlier_factor: float = typer.Option(20.0, "--outlier-factor",
                                         help="Drop rows whose split-state norm exceeds this x the median; 0 keeps all."),
    checkpoint_every: int = typer.Option(8, "--checkpoint-every", help="Sequences between checkpoints."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK,
):
    """One pass over calibration text: float64 statistics of the split state and every late layer's input."""
    from ridgefill.method.calibrate import calibrate_command

    calibrate_command(model, data, split, tokens, seq_len, out, resume, holdout, skip_first, outlier_factor,
                      checkpoint_every, dtype, device, chunk)


@app.command()
def fit(
    stats: Path = typer.Option(..., "--stats", help="Statistics from `ridgefill calibrate`."),
    out: Path = typer.Option(..., "--out", help="Maps file (.safetensors) to write; a JSON summary goes beside it."),
    split: Optional[int] = typer.Option(None, "--split", help="Which split to fit (needed if the stats hold several)."),
    lam: str = typer.Option("auto", "--lam", help="'auto' (per layer, by held-out error) or a λ relative to "
                            "trace(Pxx)/H (Pxx: the centred XᵀX)."),
    kind: str = typer.Option("ridge", "--kind", help="ridge (fitted maps) or identity (x itself, no fit)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="Keep only the top-r directions of each map's residual."),
):
    """Fit per-layer maps in closed form and print held-out error of identity fill vs the map."""
    from ridgefill.method.fit import fit_command

    fit_command(stats, out, split, lam, kind, rank)


@app.command()
def generate(
    model: str = MODEL,
    maps: Optional[Path] = typer.Option(None, "--maps", help="Maps file for filled prefill."),
    split: Optional[int] = typer.Option(None, "--split", help="Split S (checked against the maps)."),
    tail: int = typer.Option(256, "--tail", help="Last prompt rows that run the full model."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    exact: bool = typer.Option(False, "--exact", help="Exact prefill (no maps)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate (greedy)."),
    compare: bool = typer.Option(False, "--compare", help="Run exact and filled; print both with their TTFT."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK,
):
    """Generate greedily after exact or filled prefill. Only generated text goes to stdout."""
    from ridgefill.serve.generate import generate_command

    generate_command(model, maps, split, tail, keep_first, exact, prompt, prompt_file, max_new_tokens, compare,
                     dtype, device, chunk)


@app.command()
def demo(out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Run folder (default runs/quickstart).")):
    """The main job on the embedded model: `ridgefill run recipes/quickstart.toml` (calibrate, fit, then exact
    vs identity vs ridge NLL on Shakespeare, and the report)."""
    from ridgefill.pipeline.recipe import run_recipe

    run_recipe("quickstart", out_dir)


@app.command()
def longbench(
    model: str = MODEL,
    maps: Optional[Path] = MAPS,
    split: Optional[int] = SPLIT,
    tail: int = typer.Option(256, "--tail", help="Last prompt rows that run the full model."),
    data: str = typer.Option(..., "--data", help="LongBench v2 records: .json list or .jsonl file, or a Hub "
                             "dataset id (THUDM/LongBench-v2)."),
    mode: str = typer.Option("loglik", "--mode", help="loglik (compare the letters' log-likelihood) or "
                             "generate (greedy, extract 'The correct answer is (X)')."),
    max_len: Optional[int] = typer.Option(None, "--max-len", help="Longer prompts keep their first and last "
                                          "halves (default: the model's context)."),
    out: Path = typer.Option(..., "--out", help="Result JSON to write."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Run only the first N questions."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    variants: Optional[str] = typer.Option(None, "--variants", help="Comma-separated: exact, identity, ridge "
                                           "(default: all; ridge only with --maps)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template",
                                       help="Wrap prompts in the tokenizer's chat template when it has one."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate (generate mode)."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK, exact_cache: Optional[Path] = EXACT_CACHE,
):
    """LongBench v2 accuracy (overall, easy/hard, short/medium/long) for exact, identity and ridge prefill."""
    from ridgefill.evals.longbench import longbench_command

    longbench_command(model=model, maps=maps, split=split, tail=tail, data=data, mode=mode, max_len=max_len,
                      out=out, limit=limit, keep_first=keep_first, seed=seed, chunk=chunk, dtype=dtype,
                      device=device, variants=variants, chat_template=chat_template, max_new_tokens=max_new_tokens,
                      exact_cache=exact_cache)


@app.command("lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lm_eval(ctx: typer.Context):
    """lm-evaluation-harness with the `ridgefill` model registered; all arguments go to lm-eval, e.g.
    --model ridgefill --model_args pretrained=M,maps=MAPS,tail=256 --tasks T (fill=identity,split=S: identity;
    no maps: exact)."""
    from ridgefill.evals.lm_eval_model import lm_eval_command

    lm_eval_command(args=list(ctx.args))


LONG_DATA = typer.Option(..., "--data", help="Text whose evaluation documents are cut into --context passages: "
                         ".txt/.jsonl file or folder, Hub dataset, or 'wiki-leads' / 'shakespeare'.")
SHORT = typer.Option(512, "--short", help="Short window (tokens) whose loss marks distant-context tokens.")
SHORT_STRIDE = typer.Option(None, "--short-stride", help="Tail tokens per short window (each sees short..short+"
                            "stride-1 tokens); 1 = exactly --short each. Default: short // 8.")
ALPHA = typer.Option(2.0, "--alpha", help="Distant-context token: full-context log-prob gain over the short "
                     "window above alpha ...")
BETA = typer.Option(2.0, "--beta", help="... and full-context log-prob above -beta (LongPPL's key tokens).")


@app.command()
def loss(
    model: str = MODEL,
    maps: Optional[Path] = MAPS,
    split: Optional[int] = SPLIT,
    tail: int = typer.Option(256, "--tail", help="Last rows of each passage that run the full model (scored)."),
    data: str = LONG_DATA,
    context: int = typer.Option(4096, "--context", help="Tokens per passage."),
    short: int = SHORT, short_stride: Optional[int] = SHORT_STRIDE, alpha: float = ALPHA, beta: float = BETA,
    samples: int = typer.Option(16, "--samples", help="Passages to score."),
    out: Path = typer.Option(..., "--out", help="Result JSON to write."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    variants: Optional[str] = typer.Option(None, "--variants", help="Comma-separated: exact, identity, ridge "
                                           "(default: all; ridge only with --maps)."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK, exact_cache: Optional[Path] = EXACT_CACHE,
):
    """Teacher-forced tail NLL of each variant on long passages, on all tail tokens and on distant-context tokens."""
    from ridgefill.evals.loss import loss_command

    loss_command(model=model, maps=maps, split=split, tail=tail, data=data, context=context, short=short,
                 short_stride=short_stride, samples=samples, alpha=alpha, beta=beta, keep_first=keep_first,
                 variants=variants, seed=seed, chunk=chunk, dtype=dtype, device=device, out=out,
                 exact_cache=exact_cache)


@app.command()
def splice(
    model: str = MODEL,
    maps: Optional[Path] = typer.Option(None, "--maps", help="Maps file (the ridge fill)."),
    split: Optional[int] = SPLIT,
    tail: int = typer.Option(256, "--tail", help="Last rows of each passage that run the full model (scored)."),
    swap: Optional[str] = typer.Option(None, "--swap", help="Comma-separated swaps of keys, values, key-scale, "
                                       "key-direction, state; join with '+' (default: each, and keys+values)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layer ranges to splice over, e.g. 16-29,20-29 "
                                         "(default: the filled range S..L-1)."),
    by_quarter: bool = typer.Option(False, "--by-quarter", help="Also splice over each quarter of the filled range."),
    data: str = LONG_DATA,
    context: int = typer.Option(4096, "--context", help="Tokens per passage (and per needle prompt)."),
    short: int = SHORT, short_stride: Optional[int] = SHORT_STRIDE, alpha: float = ALPHA, beta: float = BETA,
    samples: int = typer.Option(8, "--samples", help="Passages to score."),
    needles: int = typer.Option(0, "--needles", help="Needle prompts (needles in the filled region) to answer "
                                "from each cache; 0 = NLL only."),
    task: str = typer.Option("niah_single_1", "--task", help="RULER task of the needle prompts."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Cap on generated answer tokens "
                                                 "(default: RULER's budget for the task)."),
    fill: Optional[str] = typer.Option(None, "--fill", help="The filled cache to splice: ridge or identity "
                                       "(default: ridge with --maps, else identity)."),
    out: Path = typer.Option(..., "--out", help="Result JSON to write."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap and needle seed."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK,
):
    """Swap exact cache components into the filled cache: which one carries the fill's error."""
    from ridgefill.evals.splice import splice_command

    splice_command(model=model, maps=maps, split=split, tail=tail, swap=swap, layers=layers, by_quarter=by_quarter,
                   data=data, context=context, short=short, short_stride=short_stride, samples=samples, alpha=alpha,
                   beta=beta, needles=needles, task=task, max_new_tokens=max_new_tokens, fill=fill,
                   keep_first=keep_first, seed=seed, chunk=chunk, dtype=dtype, device=device, out=out)


@app.command()
def ruler(
    model: str = MODEL,
    maps: Optional[Path] = MAPS,
    split: Optional[int] = SPLIT,
    tail: int = typer.Option(256, "--tail", help="Last prompt rows that run the full model."),
    lengths: str = typer.Option("4096", "--lengths", help="Comma-separated prompt + generation lengths (tokens)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Comma-separated RULER tasks (default: all 11)."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Samples per task and length (default 25; "
                                          "with --from-jsonl: the first N records, default all)."),
    region: str = typer.Option("filled", "--region", help="Where the needles go: filled (rows the fill fills), "
                               "tail, or any."),
    seed: int = typer.Option(0, "--seed", help="Sample and bootstrap seed."),
    out: Path = typer.Option(..., "--out", help="Result JSON to write."),
    variants: Optional[str] = typer.Option(None, "--variants", help="Comma-separated: exact, identity, ridge "
                                           "(default: all; ridge only with --maps)."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    haystack: str = typer.Option("auto", "--haystack", help="noise, essay, or auto (each task's RULER default)."),
    essay_corpus: str = typer.Option("wiki-leads", "--essay-corpus", help="Essay haystack text: wiki-leads or "
                                     "shakespeare (evaluation documents)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Cap on RULER's generation "
                                                 "budgets (niah 128, vt 30, cwe 120, fwe 50)."),
    from_jsonl: Optional[Path] = typer.Option(None, "--from-jsonl", help="Score RULER jsonl records (input, "
                                              "outputs, length, answer_prefix) instead of generating samples."),
    chat_template: bool = typer.Option(False, "--chat-template", help="Wrap inputs in the tokenizer's chat "
                                       "template (default: plain text, as RULER's base template)."),
    dtype: str = DTYPE, device: str = DEVICE, chunk: int = CHUNK, exact_cache: Optional[Path] = EXACT_CACHE,
):
    """RULER's synthetic tasks with needles in filled rows (or the tail): score of exact, identity and ridge."""
    from ridgefill.evals.ruler import ruler_command

    ruler_command(model=model, maps=maps, split=split, tail=tail, lengths=lengths, tasks=tasks, samples=samples,
                  region=region, seed=seed, out=out, variants=variants, keep_first=keep_first, chunk=chunk,
                  dtype=dtype, device=device, haystack=haystack, essay_corpus=essay_corpus,
                  max_new_tokens=max_new_tokens, from_jsonl=from_jsonl, chat_template=chat_template,
                  exact_cache=exact_cache)


@app.command()
def run(
    recipe: str = typer.Argument(..., help="Recipe file (e.g. recipes/quickstart.toml) or a shipped recipe's name."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Run folder (default runs/<recipe name>)."),
    force: Optional[list[str]] = typer.Option(None, "--force", help="Recompute this step even if its artifacts "
                                              "are cached (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe and list its tasks; run nothing."),
):
    """Run a recipe: calibrate → fit → evaluations as one cached pipeline, then write the report."""
    from ridgefill.pipeline.recipe import run_recipe

    run_recipe(recipe, out_dir, tuple(force or ()), dry_run)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="Run folder (from `ridgefill run`) or any folder of result JSONs."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", help="Retrieval points below exact that still "
                                              "count as equal quality for the useful split (default: the "
                                              "recipe's, else 5)."),
):
    """Write report.md and PNG plots from the results in a run folder."""
    from ridgefill.report.write import write_report

    print(write_report(run_dir, tolerance))


@app.command("bench-ttft")
def bench_ttft(
    model: str = MODEL,
    maps: Optional[Path] = typer.Option(None, "--maps", help="Maps file (from ridgefill fit) for the ridge variant."),
    split: Optional[int] = typer.Option(None, "--split", help="Split S (the maps carry it; identity needs it)."),
    tail: int = typer.Option(256, "--tail", help="Last prompt rows that run the full model."),
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="Prompt lengths (tokens), comma-separated."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs of each variant per length (interleaved)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs of each variant per length, first."),
    device: str = DEVICE, dtype: str = DTYPE,
    out: Path = typer.Option(Path("ttft.json"), "--out", help="Result JSON (raw samples included)."),
    variants: Optional[str] = typer.Option(None, "--variants", help="exact plus identity and/or ridge "
                                           "(default: all that the options allow)."),
    data: str = typer.Option("wiki-leads", "--data", help="Prompt text (evaluation documents), or 'random' ids."),
    keep_first: int = typer.Option(1, "--keep-first", help="Leading rows run in full (the attention sink)."),
    chunk: int = CHUNK,
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0: torch's default)."),
    projection: str = typer.Option("auto", "--projection", help="Fill projection: auto (Triton on CUDA, else "
                                   "torch), torch, triton, or layers (per layer, unfused)."),
    seed: int = typer.Option(0, "--seed", help="Seed of random prompts and bootstrap intervals."),
):
    """Time to first token: exact vs filled prefill vs transformers, with the FLOP-limit speedup."""
    from ridgefill.evals.bench_ttft import bench_ttft_command

    bench_ttft_command(model=model, maps=maps, split=split, tail=tail, lengths=lengths, repeats=repeats,
                       warmup=warmup, device=device, dtype=dtype, out=out, variants=variants, data=data,
                       keep_first=keep_first, chunk=chunk, threads=threads, projection=projection, seed=seed)


def main() -> None:
    """Console-script entry point: one-line errors with exit code 2 instead of tracebacks."""
    from typer.exceptions import TyperException

    try:
        code = app(standalone_mode=False)  # command-line errors come back here instead of as a usage box
    except RidgefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except TyperException as exc:  # a missing or unknown option or command, a value of the wrong type
        ctx, message = getattr(exc, "ctx", None), exc.format_message().rstrip(".")
        if message:  # (no arguments at all: the help was printed)
            command = ctx.command_path if ctx is not None else "ridgefill"
            print(f"error: {message}: see '{command} --help'", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted (artifacts already written are complete; rerun to continue)", file=sys.stderr)
        sys.exit(130)
    if isinstance(code, int) and code:  # --help / --version exit through click with a code
        sys.exit(code)
