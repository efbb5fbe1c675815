"""serve/ as the engine-neutral front: an engine without a server (backends.SERVERS) is refused in one line (serve
and bench-serve, exit 2, before anything loads); every server overrides the seam (backends/serving.Server); the request guard follows the dialect of whatever engine it is given
(not only vLLM's); serve/ imports no engine's module, and no module outside an engine's folder imports that engine's
package; every string that names a module path of ours (entry point, guard, forkserver preload, the plugin's model
classes and admission processor) names one that exists."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from helpers import run_captured
from ridgefill.backends import DEFAULT_ENGINE, ENGINES, SERVERS, SERVING_DEFAULT, server_of
from ridgefill.backends.serving import GuardDialect, LogDialect, Server
from ridgefill.serve import serve
from ridgefill.serve.guard import RequestGuard

SRC = Path(serve.__file__).resolve().parents[1]  # src/ridgefill


def main(monkeypatch, capfd, *args) -> tuple[int, str]:
    """`ridgefill ARGS` through the console entry point: (exit code, stderr)."""
    done = run_captured(list(args), capfd, monkeypatch)
    return done.returncode, done.stderr


@pytest.mark.parametrize("command", [["serve", "--split", "3"], ["bench-serve", "--split", "3", "--out", "o.json"]])
@pytest.mark.parametrize("engine", [name for name in ENGINES if name not in SERVERS])
def test_an_engine_without_a_server_is_refused_in_one_line(command, engine, monkeypatch, capfd, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve, "launch", lambda plan: pytest.fail(f"serve would start a server: {plan.argv}"))
    code, err = main(monkeypatch, capfd, *command, "--engine", engine)
    assert code == 2 and err == (f"error: serving is not supported with --engine {engine}: use --engine "
                                 f"{' or '.join(SERVERS)}\n"), err
    assert not list(tmp_path.iterdir())


def test_every_server_overrides_the_seam_and_the_default_engine_has_one():
    assert SERVING_DEFAULT in SERVERS and set(SERVERS) <= set(ENGINES)
    for name in SERVERS:
        server = server_of(name)
        assert isinstance(server, Server) and server.name == name and server.title
        assert isinstance(server.guard, GuardDialect) and isinstance(server.log, LogDialect)
        for method in ("served_dtype", "launch", "context_args", "drive"):
            assert getattr(type(server), method) is not getattr(Server, method), (name, method)
    with pytest.raises(ValueError, match="names no engine with a server"):
        RequestGuard(lambda *a: None, environ={"RIDGEFILL_GUARD_ENGINE": DEFAULT_ENGINE})


class Recorder:
    """An app behind the guard: what reached it."""

    def __init__(self) -> None:
        self.reached = None

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.reached = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def ask(guard, body: bytes, headers: dict | None = None) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


def test_the_guard_follows_another_servers_dialect():
    """A fourth engine's server: options under `ridgefill`, its key in FOURTH_KEY, its own key check named Keys."""
    dialect = GuardDialect(options_field="ridgefill", key_env="FOURTH_KEY", auth_middleware="Keys")
    app = Recorder()
    guard = RequestGuard(app, environ={"FOURTH_KEY": "k"}, dialect=dialect)
    assert guard.tokens == [hashlib.sha256(b"k").digest()]
    key = {"Authorization": "Bearer k"}
    bad = json.dumps({"prompt": "x", "ridgefill": {"ridgefill_tail": True}}).encode()
    assert ask(guard, bad) == 401 and app.reached is None  # the key before any byte of the body
    assert ask(guard, bad, key) == 400 and app.reached is None
    good = json.dumps({"prompt": "x", "ridgefill": {"ridgefill_tail": 8}, "vllm_xargs": {"x": 1}}).encode()
    assert ask(guard, good, key) == 200 and app.reached == good
    vllms = json.dumps({"prompt": "x", "vllm_xargs": {"ridgefill_tail": True}}).encode()
    assert ask(guard, vllms, key) == 200  # vLLM's field is not this server's: passed on as it came

    class Keys:  # the server's own key check, inside the app: its keys win over the environment's
        def __init__(self) -> None:
            self.app, self.api_tokens = None, [hashlib.sha256(b"own").digest()]

    assert RequestGuard(Keys(), environ={"FOURTH_KEY": "k"}, dialect=dialect).tokens == Keys().api_tokens


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_serve_imports_no_engine_and_engines_are_imported_only_in_their_folders():
    engines = {name: ENGINES[name][0].removesuffix(".backend") for name in ENGINES}  # ridgefill.backends.<engine>
    for path in sorted((SRC / "serve").glob("*.py")):
        bad = {m for m in imports_of(path) for e in engines.values() if m == e or m.startswith(e + ".")}
        assert not bad, f"{path.name} imports an engine's module directly: {sorted(bad)}"
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for package, folder in (("vllm", "backends/vllm/"), ("llama_cpp", "backends/llamacpp/")):
            mine = {m for m in imports_of(path) if m == package or m.startswith(package + ".")}
            assert not mine or rel.startswith(folder), f"{rel} imports {package}"


def names(target: str) -> bool:
    """Whether `module:attr` or `module.attr` (or a bare module) names a module of ours that defines it."""
    if ":" in target:
        module, _, attr = target.partition(":")
    else:
        try:
            whole = importlib.util.find_spec(target)
        except ModuleNotFoundError:  # a name inside a module
            whole = None
        module, attr = (target, "") if whole is not None else (target.rpartition(".")[0], target.rpartition(".")[2])
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a package on the way is missing
        spec = None
    if spec is None or not spec.origin:
        return False
    if not attr:
        return True
    tree = ast.parse(Path(spec.origin).read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    return attr in defined


def test_every_module_path_we_write_as_a_string_exists():
    import tomllib

    from ridgefill.backends.vllm import server as vserving
    from ridgefill.backends.vllm.worker import FORKSERVER_PRELOAD

    admission = SRC / "backends" / "vllm" / "plugin" / "admission.py"  # imports vLLM: read, not imported
    qualname = next(n.value.value for n in ast.walk(ast.parse(admission.read_text())) if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "QUALNAME")

    project = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())["project"]
    targets = [project["entry-points"]["vllm.general_plugins"]["ridgefill"], project["scripts"]["ridgefill"],
               vserving.PLUGIN_TARGET, serve.GUARD, *[m for m in FORKSERVER_PRELOAD if m.startswith("ridgefill.")],
               qualname, *(module for module, _ in ENGINES.values())]
    missing = [t for t in targets if not names(t)]
    assert not missing, missing
    assert not names("ridgefill.serve.vllm.plugin:register") and not names("ridgefill.serve.guard.NoSuchGuard")
    entry = (SRC / "backends" / "vllm" / "plugin" / "entry.py").read_text()
    assert 'f"ridgefill.backends.vllm.plugin.model:RidgeFill{arch}"' in entry
    from ridgefill.backends.vllm.config import ARCHITECTURES

    assert all(names(f"ridgefill.backends.vllm.plugin.model:RidgeFill{arch}") for arch in ARCHITECTURES)
