"""`ridgefill generate`: greedy generation after exact or filled prefill, with time to first token."""

from __future__ import annotations

import sys
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.runtime.console import note
from ridgefill.runtime.session import open_session


# --- generate ----------------------------------------------------------------------------------------
def generate_command(model, maps, split, tail, keep_first, exact, prompt, prompt_file, max_new_tokens, compare,
                     dtype, device, chunk) -> dict:
    if (prompt is None) == (prompt_file is None):
        raise RidgefillError("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        if not Path(prompt_file).is_file():
            raise RidgefillError(f"--prompt-file {prompt_file} does not exist")
        prompt = Path(prompt_file).read_text()
    if exact and compare:
        raise RidgefillError("--compare already runs exact: drop --exact")
    if not exact and maps is None:
        raise RidgefillError("filled prefill needs --maps (from ridgefill fit), or pass --exact")
    if max_new_tokens < 1:
        raise RidgefillError("--max-new-tokens must be at least 1")
    session = open_session(model, dtype, device, chunk)
    ids = session.tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]
    if ids.shape[1] == 0:
        raise RidgefillError("the prompt is empty after tokenization")
    limit = session.engine.adapter.max_positions
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise RidgefillError(f"prompt ({ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceed the model's "
                             f"context of {limit}: shorten the prompt")
    plan = None
    if not exact:
        plan, _ = session.fill_plan(maps, split, tail, range(keep_first))
        if tail >= ids.shape[1]:
            note(f"note: tail {tail} >= prompt length {ids.shape[1]}: every row runs the full model (exact)")
    eos = session.tokenizer.eos_token_id
    runs = {}
    if exact or compare:
        runs["exact"] = session.engine.generate(ids, max_new_tokens, None, eos)
    if plan is not None:
        runs["filled"] = session.engine.generate(ids, max_new_tokens, plan, eos)
    texts = {k: session.tokenizer.decode(r.tokens[0], skip_special_tokens=True) for k, r in runs.items()}
    if compare:
        for name, r in runs.items():
            share = r.prefill.filled_share
            note(f"[{name}] ttft {r.ttft_s * 1000:.0f} ms, {share:.0%} of {ids.shape[1]} prompt rows filled")
            print(f"=== {name} ===\n{texts[name]}")
        note("outputs are identical" if texts["exact"] == texts["filled"] else "outputs differ")
    else:
        (name, r), = runs.items()
        note(f"ttft {r.ttft_s * 1000:.0f} ms, {r.prefill.filled_share:.0%} of {ids.shape[1]} prompt rows filled")
        sys.stdout.write(texts[name] + "\n")
    return texts
