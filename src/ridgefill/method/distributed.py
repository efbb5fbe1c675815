"""A command's processes: this process's place among torchrun's (World: rank, size, the collectives; the process
group set up and torn down) and `--nproc N`, the same command re-launched under torch.distributed.run on this
machine. calibrate uses them (docs/calibration.md)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ridgefill.commands import Config, options
from ridgefill.errors import RidgefillError
from ridgefill.runtime.console import note


# --- the processes --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    """This process among the calibration processes: rank 0 holds the global statistics, decides, writes and
    reports; with one process every collective is a no-op."""

    rank: int = 0
    size: int = 1

    @property
    def root(self) -> bool:
        return self.rank == 0

    def from_root(self, value):
        """Rank 0's `value` (any picklable object) on every process."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_sum(self, tensor: torch.Tensor) -> None:
        """Add every process's `tensor` into rank 0's, in place."""
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)


@contextmanager
def joined_world(device: str) -> Iterator[World]:
    """This process's World for the body of the `with`, and the process group shut down after it: on a clean exit
    every rank first waits for the others (a barrier: no rank tears its end down while another still runs a
    collective or rank 0, which hosts the rendezvous store, still writes), then destroys the group, so every rank
    exits 0. After an exception the group is destroyed without the barrier (a rank that failed alone must not wait
    for the others' collectives)."""
    world = join_world(device)
    try:
        yield world
    except BaseException:
        leave_world(world, clean=False)
        raise
    leave_world(world)


def join_world(device: str) -> World:
    """This process's place among torchrun's processes (WORLD_SIZE, RANK, LOCAL_RANK and the rendezvous's
    MASTER_ADDR / MASTER_PORT), its process group initialised: nccl for --device cuda (one GPU per local rank),
    gloo on the CPU. Without WORLD_SIZE > 1: the only process."""
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        return World()
    rank = _env_int("RANK", 0)
    backend = "nccl" if device == "cuda" else "gloo"
    # torch._dynamo is imported before the group exists: imported after it (the model's loading imports it), it
    # keeps a reference to the default group that destroy_process_group does not drop (torch 2.13), so gloo's
    # threads outlived leave_world and were torn down at interpreter exit, where a rank died with SIGABRT
    # ("terminate called without an active exception"). tests/method/test_processes.py checks they are gone.
    import torch._dynamo  # noqa: F401
    try:
        if device == "cuda":
            torch.cuda.set_device(_env_int("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        dist.init_process_group(backend, rank=rank, world_size=size)
    except Exception as exc:  # a missing variable, an unreachable rendezvous, a backend that cannot start
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RidgefillError(f"cannot initialise torch.distributed ({backend}, rank {rank} of {size}): {reason}; "
                             "run under torchrun, or set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK") from None
    return World(rank, size)


def leave_world(world: World, clean: bool = True) -> None:
    """Shut this process's group down (nothing for one process): with `clean`, after a barrier of every rank."""
    if world.size > 1 and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise RidgefillError(f"environment variable {name}={value!r} is not an integer: torchrun sets it") from None



# --- --nproc: the same command under torch.distributed.run -----------------------------------------------------
def relaunch_argv(config: Config, command: str, nproc: int) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m ridgefill <command> <the options
    given, without --nproc>`."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ridgefill", command]
    for o in options(type(config)).values():
        value = getattr(config, o.name)
        if o.name == "nproc" or value is None or value == o.default:
            continue
        if o.kind is bool:
            argv.append(f"--{o.flag}" if value else f"--no-{o.flag}")
        else:
            argv += [f"--{o.flag}", str(value)]
    return argv


def relaunch(config: Config, command: str, nproc: int, summary: Path) -> dict:
    """Run `command` with `config` as `nproc` processes on this machine and return the JSON summary rank 0
    wrote to `summary`."""
    argv = relaunch_argv(config, command, nproc)
    note(f"note: running {nproc} processes: {shlex.join(argv)}")
    code = subprocess.run(argv).returncode
    if code:
        raise RidgefillError(f"the {nproc} `ridgefill {command}` processes failed (exit code {code}): see their "
                             "messages above; rerun with --resume to continue from the last checkpoint")
    return json.loads(summary.read_text())
