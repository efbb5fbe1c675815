"""Helpers the test modules share (one definition each): a runner over a tiny model, transformers' own hidden
states, cache equality over both kinds of layer, a free loopback port, and the one start-up line of a vLLM plugin
registered in a probe process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

TOL = 1e-5
# For hybrid caches produced by genuinely different fp32 op orders: filled rows fed transformers' hidden states
# (another implementation of the same layers), or the delta rule cut at other chunk boundaries. Hidden states then
# agree to ~1e-5 *relative* (the linear layers' gated RMSNorm normalises small per-head outputs, which amplifies
# rounding), and keys after the per-head k-norm are O(1), so their absolute gap reaches ~2e-5. Logits (O(0.5)) stay
# within TOL and are checked at TOL; dense caches stay within TOL.
TOL_REORDERED = 1e-4


def runner_for(model, chunk=2048):
    from ridgefill.torchfill import Runner, adapter_for

    return Runner(adapter_for(model), chunk=chunk)


def hf_hidden(model, ids):
    """transformers' hidden states of `ids`: L+1 tensors [B, N, H] (the embeddings, then each layer's output)."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


def max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def assert_caches_equal(a, b, tol=TOL):
    """Two runner caches hold the same layers, lengths and contents: K/V of attention layers, recurrent and conv
    state of linear (Gated DeltaNet) layers."""
    assert len(a) == len(b)
    for la, lb in zip(a.layers, b.layers):
        assert la.kind == lb.kind and la.length == lb.length
        if la.kind == "attention":
            assert max_diff(la.keys, lb.keys) <= tol
            assert max_diff(la.values, lb.values) <= tol
        else:
            assert max_diff(la.recurrent, lb.recurrent) <= tol
            assert max_diff(la.conv, lb.conv) <= tol


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_package(monkeypatch, package: str, forget: tuple[str, ...] = ()) -> None:
    """`import package` (or any of its modules) fails as it does where the package is not installed; the modules of
    `package` and of `forget` are dropped from sys.modules, so that the next import runs again."""
    import builtins

    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name.split(".")[0] == package:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    for name in [n for n in sys.modules if n.split(".")[0] in (package, *forget)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", blocked)


def run_main(args, monkeypatch) -> int:
    """`ridgefill ARGS` through the console script's entry point (cli.main) in this process: its exit code (the
    error paths without a new process's imports, 8-10 s each on a busy machine)."""
    from ridgefill import cli

    monkeypatch.setattr(sys, "argv", ["ridgefill", *map(str, args)])
    try:
        cli.main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)


def run_captured(args, capfd, monkeypatch) -> subprocess.CompletedProcess:
    """run_main(args) with what it writes to stdout and stderr captured, as a CompletedProcess (exit code, stdout,
    stderr): a command's one-line error paths in this process."""
    capfd.readouterr()
    code = run_main(args, monkeypatch)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


# The head of a probe that registers the vLLM plugin in a process of its own: a maps file for it to read at argv[1].
PLUGIN_PROBE_HEAD = r"""
import sys
from ridgefill.runtime.artifacts import save_artifact
save_artifact(sys.argv[1], {}, {"artifact": "maps", "kind": "identity", "split": 1})
"""


def plugin_startup_line(probe: str, tmp_path) -> str:
    """Run `probe` (PLUGIN_PROBE_HEAD, then code that changes vLLM and registers the plugin) in a fresh Python
    without the caller's RIDGEFILL_ settings; it must fail, and the line `ridgefill serve` shows for it is returned
    (process.startup_error, as for a vLLM server that fails to start)."""
    from ridgefill.serve.process import startup_error

    maps = tmp_path / "maps.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIDGEFILL_")}
    r = subprocess.run([sys.executable, "-c", probe, str(maps)], capture_output=True, text=True,
                       env={**env, "RIDGEFILL_MAPS": str(maps)}, timeout=600)
    assert r.returncode != 0, r.stderr[-2000:]
    line = startup_error(r.stderr, r.returncode, tmp_path / "vllm.log")
    assert "\n" not in line
    return line


def refused_line(args: list[str], monkeypatch, capfd) -> str:
    """`ridgefill ARGS` through the console entry point: exit 2 and one line on stderr, which is returned."""
    import sys

    import pytest

    from ridgefill import cli

    monkeypatch.setattr(sys, "argv", ["ridgefill", *args])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capfd.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()
