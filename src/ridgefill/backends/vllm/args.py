"""vLLM's command-line options as `ridgefill serve` reads them among the arguments it hands on (no vLLM import):
an argument's option name as vLLM's parser reads it, an option's value, a boolean option's state, and the API key,
which serve takes out of the arguments and hands to vLLM through its environment (VLLM_API_KEY) instead.
"""

from __future__ import annotations

from ridgefill.errors import RidgefillError

API_KEY = "--api-key"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's API server reads its key from here when no --api-key is given


def option_name(arg: str) -> str:
    """An argument's option name as vLLM reads it (`--a_b=1` -> `--a-b`, `-q` -> `-q`); "" for a value."""
    if arg.startswith("--"):
        return "--" + arg[2:].split("=", 1)[0].replace("_", "-")
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
        return arg.split("=", 1)[0]
    return ""


def option_value(args: list[str], name: str) -> str | None:
    """The last value vLLM would read for option `name` among `args` (`--name v` or `--name=v`)."""
    value = None
    for i, arg in enumerate(args):
        if option_name(arg) == name:
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def option_flag(args: list[str], name: str) -> bool:
    """Whether a boolean option `name` is on among `args` (`--name`, or `--name=true`), the last one winning
    over its `--no-` form."""
    on = False
    for arg in args:
        option = option_name(arg)
        if option == name:
            on = "=" not in arg or arg.split("=", 1)[1].strip().lower() not in ("false", "0", "no")
        elif option == "--no-" + name[2:]:
            on = False
    return on


def refuse_abbreviations(args: list[str], own: list[str]) -> None:
    """Refuse, in one line naming the full option, an argument that abbreviates one of the options `own` (vLLM's
    parser reads `--api-k K` as `--api-key K`; an abbreviation of serve's own option would reach vLLM as something
    else, or not at all). No option of vLLM's is a strict prefix of serve's own (tests/backends/vllm/test_vllm_cli.py
    checks it against vLLM's parser), so nothing vLLM takes is refused here."""
    for arg in args:
        name = option_name(arg)
        if not name.startswith("--") or name in own:
            continue
        full = [o for o in own if o.startswith(name)]
        if full and len(name) > 2:
            why = (f"write {API_KEY} in full: serve takes the key off vLLM's command line, which every local user "
                   f"can read, only then" if API_KEY in full else "write it in full")
            raise RidgefillError(f"{arg}: an abbreviation of serve's {' or '.join(sorted(full))}: {why}")


def split_api_key(args: list[str]) -> tuple[list[str], str | None]:
    """`args` without vLLM's --api-key (it takes one or more values: `--api-key K`, `--api-key=K`), and the key the
    last one gave (None without one). More than one key, or none after the option, is refused: serve hands vLLM one
    key, through VLLM_API_KEY, because a child's command line is readable by every user of the machine; so is an
    abbreviation of --api-key, which vLLM would read as the option."""
    refuse_abbreviations(args, [API_KEY])
    rest, keys, i = [], None, 0
    while i < len(args):
        if option_name(args[i]) != API_KEY:
            rest.append(args[i])
            i += 1
            continue
        arg, i = args[i], i + 1
        keys = [arg.split("=", 1)[1]] if "=" in arg else []
        while "=" not in arg and i < len(args) and not option_name(args[i]):  # vLLM's --api-key takes 1 or more
            keys.append(args[i])
            i += 1
        _check_keys(keys)
    return rest, (keys[0] if keys else None)


def _check_keys(keys: list[str]) -> None:
    if not keys or not keys[0]:
        raise RidgefillError(f"{API_KEY} needs a key: give {API_KEY} KEY, or set {API_KEY_ENV}")
    if len(keys) > 1:
        raise RidgefillError(f"{API_KEY} gives {len(keys)} keys: serve hands vLLM one key, through {API_KEY_ENV} "
                             "(never on its command line, which every local user can read): give one")
