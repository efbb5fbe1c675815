"""The command registry: every command is one Config + run, and the command line is built from it alone."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click.testing
import pytest
from typer.testing import CliRunner

from ridgefill.cli import app, click_command
from ridgefill.commands import REGISTRY, REQUIRED, Command, Config, command, option, steps
from ridgefill.errors import RidgefillError


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_registered_command_is_one_definition(name):
    cmd = command(name)
    assert cmd.name == name and cmd.summary
    flags = list(cmd.options)
    assert len(flags) == len(set(flags))
    for o in cmd.options.values():
        assert o.help, f"{name} --{o.flag} has no help"
        if o.role in ("input", "output", "store"):  # the runner passes a file or folder
            assert o.kind is Path, f"{name} --{o.flag}"


@pytest.mark.parametrize("name", [n for n in REGISTRY if n != "lm-eval"])
def test_help_lists_every_option_of_the_config(name):
    r = CliRunner().invoke(app, [name, "--help"], terminal_width=200, env={"COLUMNS": "200"})  # rich reads COLUMNS
    assert r.exit_code == 0, r.output
    cmd = command(name)
    for o in cmd.options.values():
        if not o.positional and o.name != cmd.extra_args:  # (the arguments no option takes: not an option)
            assert f"--{o.flag}" in r.output


def test_steps_are_the_commands_that_write_an_artifact():
    assert steps() == ["calibrate", "fit", "ruler", "loss", "splice", "longbench", "bench-ttft"]
    assert all(command(s).writes for s in steps())
    makers = {command(s).makes: s for s in steps() if command(s).makes}
    assert makers == {"stats": "calibrate", "maps": "fit"}
    assert {command(s).reads for s in steps()} <= {None, "stats", "maps"}


def test_top_level_help_imports_no_command_module():
    code = ("import sys\nfrom ridgefill.cli import main\nsys.argv = ['ridgefill', '--help']\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.startswith('ridgefill.')))\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    modules, torch_loaded = r.stdout.strip().splitlines()[-2:]
    assert modules == "['ridgefill.cli', 'ridgefill.commands', 'ridgefill.errors']" and torch_loaded == "False"
    assert all(name in r.stdout for name in REGISTRY)


# --- an option is declared in one place ------------------------------------------------------------------------
@dataclass
class ToyConfig(Config):
    count: int = option(3, "How many.")
    name: str = option(REQUIRED, "A name.")
    scale: float | None = option(None, "An optional number.")
    where: Path = option(Path("out.json"), "A path.")
    loud: bool = option(False, "A flag.")
    tags: str | None = option(None, "A comma-separated list.", listed=str)

    def check(self) -> None:
        if self.count < 1:
            raise RidgefillError("--count must be at least 1")


def toy(calls: list) -> Command:
    return Command("toy", ToyConfig, lambda config: calls.append(config) or {"ok": True})


def test_a_config_field_is_a_command_line_option(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", REGISTRY["fit"])  # any summary will do
    calls = []
    cli = click_command(toy(calls))
    r = click.testing.CliRunner().invoke(cli, ["--name", "x", "--count", "5", "--scale", "0.5", "--loud", "--tags", "a,b"])
    assert r.exit_code == 0, r.output
    (config,) = calls
    assert (config.count, config.name, config.scale, config.where, config.loud, config.tags) == \
        (5, "x", 0.5, Path("out.json"), True, "a,b")
    assert config.as_dict()["where"] == "out.json"


def test_command_checks_its_config_before_running(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", REGISTRY["fit"])
    calls = []
    cmd = toy(calls)
    with pytest.raises(RidgefillError, match="--count must be at least 1"):
        cmd(name="x", count=0)
    with pytest.raises(RidgefillError, match="needs --name"):
        cmd(count=2)
    with pytest.raises(RidgefillError, match="has no option colour"):
        cmd(name="x", colour="red")
    assert cmd(name="x") == {"ok": True} and calls[0].count == 3


@dataclass
class HandOnConfig(Config):
    tail: int = option(8, "A declared option.")
    loud: bool = option(False, "A declared flag.")
    rest: list[str] = option([], "the options of the other program.")


def test_extra_args_get_every_argument_the_command_does_not_declare(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", REGISTRY["fit"])
    calls = []
    cmd = Command("toy", HandOnConfig, lambda config: calls.append(config) or 0, extra_args="rest")
    cli = click_command(cmd)
    args = ["--max-model-len", "256", "--tail", "3", "-tp", "2", "--a_b=x", "--loud", "--flag", "value"]
    r = click.testing.CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    (config,) = calls
    assert (config.tail, config.loud) == (3, True)
    assert config.rest == ["--max-model-len", "256", "-tp", "2", "--a_b=x", "--flag", "value"]  # in order
    r = click.testing.CliRunner().invoke(cli, ["--help"], terminal_width=200)
    assert r.exit_code == 0 and "--tail" in r.output and "the options of the other program" in r.output
    assert "--rest" not in r.output
    assert cmd(rest=["--x"]) == 0 and calls[-1].rest == ["--x"]  # in-process: the option by name


def test_a_run_that_returns_an_int_sets_the_exit_code(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", REGISTRY["fit"])
    cli = click_command(Command("toy", HandOnConfig, lambda config: config.tail, extra_args="rest"))
    assert click.testing.CliRunner().invoke(cli, ["--tail", "5"]).exit_code == 5
    assert click.testing.CliRunner().invoke(cli, ["--tail", "0"]).exit_code == 0


def test_extra_args_must_name_a_list_of_strings():
    with pytest.raises(TypeError, match="not a list\\[str\\] option"):
        Command("toy", HandOnConfig, lambda config: None, extra_args="tail")
    with pytest.raises(TypeError, match="not a list\\[str\\] option"):
        Command("toy", HandOnConfig, lambda config: None, extra_args="nosuch")


def test_unknown_command_is_a_one_line_error():
    with pytest.raises(RidgefillError, match="unknown command 'nosuch'"):
        command("nosuch")
