"""The request guard in the dialect of a server whose requests carry RidgeFill's options as top-level fields
(GuardDialect.options_field "": the llama.cpp front before llama-server, --engine llamacpp): the key before any
body, the ridgefill_* fields checked as the client wrote them (escapes decoded), every other body passed on
unparsed."""

from __future__ import annotations

import hashlib
import json

from ridgefill.backends import server_of
from ridgefill.backends.serving import GuardDialect
from ridgefill.serve.guard import RequestGuard, body_error, needs_parse
from test_front import Recorder, ask


def test_top_level_options_are_checked_and_other_bodies_pass_unparsed():
    dialect = GuardDialect(options_field="", key_env="TOP_KEY")
    app = Recorder()
    guard = RequestGuard(app, environ={"TOP_KEY": "k"}, dialect=dialect)
    assert guard.tokens == [hashlib.sha256(b"k").digest()]
    key = {"Authorization": "Bearer k"}
    bad = json.dumps({"prompt": "x", "ridgefill_tail": 0}).encode()
    assert ask(guard, bad) == 401 and app.reached is None  # the key before any byte of the body
    assert ask(guard, bad, key) == 400 and app.reached is None
    escaped = b'{"prompt": "x", "ridgefill\\u005fkeep_first": -1}'
    assert ask(guard, escaped, key) == 400 and app.reached is None
    good = json.dumps({"prompt": "x", "ridgefill_tail": 8, "vllm_xargs": {"ridgefill_tail": True}}).encode()
    assert ask(guard, good, key) == 200 and app.reached == good  # vLLM's field is not this server's
    plain = json.dumps({"prompt": "x" * 1000, "max_tokens": 4}).encode()
    assert not needs_parse(plain, "") and needs_parse(bad, "")
    assert body_error(b'{"prompt": "x", "ridgefill_split": 3}', "").startswith("unknown RidgeFill request option")
    assert body_error(b'{"p": ' + b"[" * 5000 + b"]" * 5000 + b"}", "").startswith(
        "the request body's JSON nests too deeply")


def test_llamacpps_dialect_is_top_level():
    assert server_of("llamacpp").guard.options_field == ""
