"""The `ridgefill` command line, built from the command registry (commands.py): each command's options are its
Config's fields, so nothing here names a command or an option. A command's module is imported only when that
command runs or shows its help. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import click
import typer
from typer.core import TyperGroup

from ridgefill import __version__
from ridgefill.commands import REGISTRY, Command, Option, command
from ridgefill.errors import RidgefillError


class RegistryGroup(TyperGroup):
    """The commands of REGISTRY, each built into a click command the first time it is asked for."""

    listing = False  # while the group's own help is written: list commands by their registry summary

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(REGISTRY)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in REGISTRY:
            return None
        if self.listing:  # `ridgefill --help` lists every command without importing its module
            return click.Command(name, help=REGISTRY[name].summary)
        if name not in self.commands:
            self.add_command(click_command(command(name)), name)
        return self.commands[name]

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


app = typer.Typer(
    cls=RegistryGroup, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
    help="RidgeFill: fill upper-layer caches from a ridge map of the split state, and measure the cost.",
)


def _version(value: bool):
    if value:
        print(f"ridgefill {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                              help="Print the version and exit.")):
    """Calibrate once, fit closed-form maps, then fill prefill and measure it against exact."""


CONTEXT = "ctx"  # the click context's parameter of a command's callback (no Config field has this name)


def click_command(cmd: Command) -> click.Command:
    """The click command of a registered command: one typer parameter per option of its Config."""
    sub = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    if cmd.passthrough:  # every argument goes to the other program, --help included
        def passthrough(ctx: typer.Context):
            cmd(args=list(ctx.args))

        sub.command(cmd.name, help=cmd.summary, add_help_option=False,
                    context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(passthrough)
        return typer.main.get_command(sub)

    opts = [o for o in cmd.options.values() if o.name != cmd.extra_args]
    settings, epilog, metavar = {}, None, "[OPTIONS]"
    if cmd.extra_args is not None:  # undeclared options and their values are collected into that option, in order
        settings = {"allow_extra_args": True, "ignore_unknown_options": True}
        epilog = f"Every other argument: {cmd.options[cmd.extra_args.replace('_', '-')].help}"
        metavar = "[OPTIONS] [OTHER ARGUMENTS]..."

    def callback(ctx: typer.Context, **values):
        given = {o.name: (o.default if o.many and values[o.name] is None else values[o.name]) for o in opts}
        if cmd.extra_args is not None:
            given[cmd.extra_args] = list(ctx.args)
        result = cmd(**given)
        if type(result) is int and result:  # a run's exit code
            raise typer.Exit(result)

    context = inspect.Parameter(CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    callback.__signature__ = inspect.Signature([context, *(_parameter(o) for o in opts)])
    callback.__annotations__ = {CONTEXT: typer.Context, **{o.name: _annotation(o) for o in opts}}
    sub.command(cmd.name, help=cmd.summary, epilog=epilog, context_settings=settings,
                options_metavar=metavar)(callback)
    return typer.main.get_command(sub)


def _parameter(o: Option) -> inspect.Parameter:
    default = ... if o.required else (None if o.many else o.default)
    if o.positional:
        info = typer.Argument(default, help=o.help, show_default=not o.many)
    elif o.negatable:
        info = typer.Option(default, f"--{o.flag}/--no-{o.flag}", help=o.help)
    else:
        info = typer.Option(default, f"--{o.flag}", help=o.help)
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=_annotation(o))


def _annotation(o: Option):
    kind = list[o.kind] if o.many else o.kind
    return Optional[kind] if o.optional or o.many else kind


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
            name = ctx.command_path if ctx is not None else "ridgefill"
            print(f"error: {message}: see '{name} --help'", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted (artifacts already written are complete; rerun to continue)", file=sys.stderr)
        sys.exit(130)
    if isinstance(code, int) and code:  # --help / --version exit through click with a code
        sys.exit(code)

