"""`ridgefill calibrate` as processes on a tiny checkpoint: two gloo ranks give the statistics (and maps) of one
process; a calibration killed with SIGKILL (three times, or one rank of two) resumes to the uninterrupted
statistics, with any number of processes; a plain rerun does not clobber the checkpoint; bad setups are one line."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import free_port, run_captured
from ridgefill.commands import options
from ridgefill.errors import RidgefillError
from ridgefill.method.calibrate import COMMAND
from ridgefill.method.distributed import relaunch_argv
from ridgefill.runtime.artifacts import read_meta

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
# ridgefill's console entry with, at exit (before the interpreter is torn down), a line naming the gloo threads still
# running: a process group left alive is torn down with the interpreter, where a rank died with SIGABRT
THREADS_AT_EXIT = [sys.executable, "-c", """
import atexit, os, sys
def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("gloo threads at exit:", sorted(n for n in names if "gloo" in n), flush=True)
atexit.register(gloo_threads)
sys.argv[0] = "ridgefill"
from ridgefill.cli import main
main()
"""]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TIMEOUT = 300


@pytest.fixture(scope="module")
def calibrate_args(tiny_checkpoint, long_docs) -> list[str]:
    return ["calibrate", "--model", str(tiny_checkpoint), "--data", str(long_docs), "--split", "2,3",
            "--seq-len", "32", "--tokens", "6400", "--holdout", "0.2", "--checkpoint-seconds", "0"]


def cli(*args, env=ONE_THREAD) -> subprocess.CompletedProcess:
    return subprocess.run([*RIDGEFILL, *map(str, args)], capture_output=True, text=True, timeout=TIMEOUT, env=env)


def start(args, log: Path, env=ONE_THREAD, command=RIDGEFILL) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([*command, *map(str, args)], stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def reference(calibrate_args, tmp_path_factory) -> Path:
    """An uninterrupted one-process calibration."""
    out = tmp_path_factory.mktemp("reference") / "stats.safetensors"
    r = cli(*calibrate_args, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def max_relative_difference(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    worst = 0.0
    for k in x:
        scale = float(x[k].double().abs().max().clamp_min(1e-300))
        worst = max(worst, float((x[k].double() - y[k].double()).abs().max()) / scale)
    return worst


def ranks(args, out: Path, size: int = 2, command=RIDGEFILL) -> list[subprocess.Popen]:
    """`size` processes of one calibration, rendezvous by environment variables (what torchrun sets)."""
    port = free_port()
    return [start([*args, "--out", out], out.with_suffix(f".rank{rank}.log"),
                  {**ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
                   "RANK": str(rank), "LOCAL_RANK": str(rank)}, command) for rank in range(size)]


def sequences_done(partial: Path) -> int:
    try:
        return read_meta(partial, "stats")["sequences_done"]
    except RidgefillError:  # not written yet
        return 0


def wait_for_progress(partial: Path, beyond: int, processes: list[subprocess.Popen]) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done = sequences_done(partial)
        if done > beyond:
            return done
        assert all(p.poll() is None for p in processes), "a calibration process ended before it was killed"
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint beyond {beyond} sequences in {TIMEOUT} s")


def test_two_gloo_ranks_give_the_statistics_and_maps_of_one_process(calibrate_args, reference, tmp_path, capfd,
                                                                    monkeypatch):
    """Every rank exits 0 with its process group shut down: no gloo thread is left for the interpreter's exit (a rank
    died there with SIGABRT, "terminate called without an active exception", issue 50)."""
    out = tmp_path / "two.safetensors"
    processes = ranks([*calibrate_args, "--checkpoint-every", "7"], out, command=THREADS_AT_EXIT)
    codes = [p.wait(TIMEOUT) for p in processes]
    rank0, rank1 = (out.with_suffix(f".rank{r}.log").read_text() for r in (0, 1))
    assert codes == [0, 0], f"exit codes {codes}\nrank 0:\n{rank0[-3000:]}\nrank 1:\n{rank1[-3000:]}"
    assert [log.count("gloo threads at exit: []") for log in (rank0, rank1)] == [1, 1], rank0[-500:] + rank1[-500:]
    assert max_relative_difference(reference, out) <= 1e-10
    assert read_meta(out, "stats")["sequences_done"] == read_meta(reference, "stats")["sequences_done"] > 100
    assert "calibration statistics" in rank0 and "calibrating" in rank0
    assert "calibration statistics" not in rank1 and "calibrating" not in rank1  # only rank 0 reports
    maps = []
    for stats in (reference, out):
        r = run_captured(["fit", "--stats", stats, "--split", "3", "--out", stats.with_suffix(".maps.safetensors")],
                         capfd, monkeypatch)  # in this process: what is tested is the statistics
        assert r.returncode == 0, r.stderr
        maps.append(load_file(stats.with_suffix(".maps.safetensors")))
        maps[-1]["lam"] = torch.tensor([x["lam"] for x in json.loads(
            stats.with_suffix(".maps.safetensors.json").read_text())["layers"]])
    for k in maps[0]:
        assert torch.allclose(maps[0][k], maps[1][k], rtol=1e-6, atol=1e-7), k


def test_killed_three_times_then_resumed_equals_uninterrupted(calibrate_args, reference, tmp_path):
    out = tmp_path / "killed.safetensors"
    partial = Path(str(out) + ".partial")
    args = [*calibrate_args, "--checkpoint-every", "1", "--out", out]
    rng, done = random.Random(7), 0
    for attempt in range(3):
        process = start([*args, "--resume"], tmp_path / f"attempt{attempt}.log")
        done = wait_for_progress(partial, done, [process])
        time.sleep(rng.uniform(0, 0.3))  # anywhere: in a forward pass, in a checkpoint write
        process.send_signal(signal.SIGKILL)
        process.wait(TIMEOUT)
        assert not out.exists()
    plain = cli(*args)
    assert plain.returncode == 2 and len(plain.stderr.strip().splitlines()) == 1
    assert "pass --resume to continue it or --restart to start over" in plain.stderr
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert max_relative_difference(reference, out) <= 1e-12
    assert not partial.exists()


def test_one_rank_killed_and_any_number_of_processes_resumes(calibrate_args, reference, tmp_path):
    """Rank 1 of two dies; rank 0 cannot go on; the partial file (global sums) resumes under --nproc 2."""
    out = tmp_path / "rank-killed.safetensors"
    partial = Path(str(out) + ".partial")
    processes = ranks([*calibrate_args, "--checkpoint-every", "2"], out)
    wait_for_progress(partial, 4, processes)
    processes[1].send_signal(signal.SIGKILL)
    try:
        processes[0].wait(60)  # its next collective fails
    except subprocess.TimeoutExpired:
        processes[0].kill()
    processes[0].wait(TIMEOUT)
    assert not out.exists() and sequences_done(partial) >= 4
    r = cli(*calibrate_args, "--out", out, "--resume", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.distributed.run" in r.stderr  # re-launched under torchrun
    assert max_relative_difference(reference, out) <= 1e-10


def test_nproc_relaunch_repeats_every_option_but_nproc(tmp_path):
    config = COMMAND.make(data="docs.jsonl", split="2,3", out=tmp_path / "s.safetensors", nproc=3, resume=True,
                          holdout=0.25, device="cpu")
    argv = relaunch_argv(config, "calibrate", config.nproc)
    assert argv[:8] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        "-m", "ridgefill"]
    assert argv[8:] == ["calibrate", "--dtype", "fp32", "--device", "cpu", "--data", "docs.jsonl", "--split", "2,3",
                        "--out", str(tmp_path / "s.safetensors"), "--resume", "--holdout", "0.25"]  # resolved, not auto
    assert not options(type(config))["nproc"].keyed


@pytest.mark.parametrize("split,env,message", [
    ("5", {}, "split 5 leaves nothing to fit on this 6-layer model"),
    ("2", {"WORLD_SIZE": "2", "RANK": "0"}, "cannot initialise torch.distributed (gloo, rank 0 of 2)"),
    ("2", {"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x' is not an integer"),
])
def test_bad_setups_are_one_line_exit_2(calibrate_args, tmp_path, split, env, message, capfd, monkeypatch):
    """Through the console entry point in this process (a process's exit code and stderr are test_bad_input's)."""
    args = list(calibrate_args)
    args[args.index("--split") + 1] = split
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = run_captured([*args, "--out", tmp_path / "s.safetensors"], capfd, monkeypatch)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "s.safetensors").exists()
