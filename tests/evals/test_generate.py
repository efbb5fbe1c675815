"""`ridgefill generate`: the rows a user keeps in full (--keep-first, --keep-rows, --keep-text)."""

import pytest
from transformers import AutoTokenizer

from ridgefill.errors import RidgefillError
from ridgefill.evals.generate import COMMAND, GenerateConfig, keep_rows

PROMPT = "The grass is green. The sky is blue. One of the special magic numbers for king is: 1234567. What is it?"


def config(**kw) -> GenerateConfig:
    return COMMAND.make(prompt=PROMPT, exact=True, **kw)


def test_keep_text_keeps_exactly_the_tokens_of_that_text(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
    rows = keep_rows(config(keep_first=0, keep_text="magic numbers"), tok, PROMPT, len(ids))
    assert rows == list(range(rows[0], rows[-1] + 1))  # one span
    text = tok.decode(ids[rows[0]:rows[-1] + 1])
    assert "magic numbers" in text and "king" not in text and "sky" not in text


def test_keep_rows_and_keep_first_combine(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert keep_rows(config(keep_first=2, keep_rows="5-7,10"), tok, PROMPT, 30) == [0, 1, 5, 6, 7, 10]


@pytest.mark.parametrize("options,message", [
    (dict(keep_rows="3-1"), "--keep-rows '3-1': '3-1' is not a row or an increasing range"),
    (dict(keep_rows="a"), "is not a row"),
    (dict(keep_text="  "), "--keep-text is empty"),
])
def test_bad_keep_options_are_refused_before_loading(options, message):
    with pytest.raises(RidgefillError, match=message):
        config(**options).check()


def test_keep_rows_past_the_prompt_or_text_not_in_it_are_refused(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    with pytest.raises(RidgefillError, match="reaches past the 30-token prompt"):
        keep_rows(config(keep_rows="25-40"), tok, PROMPT, 30)
    with pytest.raises(RidgefillError, match="does not occur in the prompt"):
        keep_rows(config(keep_text="queen"), tok, PROMPT, 30)


def test_a_keep_first_past_the_context_is_one_line_before_any_row_is_built(tiny_checkpoint):
    """`generate --keep-first 10**9 --prompt hi` (it once built a set of 10^9 rows: tens of GB) ends with one line
    and exit 2, run as a user runs it, in an address space of 8 GiB that such a set could not fit in."""
    import resource
    import subprocess
    import sys

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    r = subprocess.run([sys.executable, "-m", "ridgefill", "generate", "--model", str(tiny_checkpoint), "--split",
                        "2", "--keep-first", str(10**9), "--prompt", "hi", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=600, preexec_fn=cap)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert lines == ["error: --keep-first 1000000000 is past the 4096 rows a prompt can have (this model's context): "
                     "give at most 4096 (a keep-first at or past the prompt already runs all of it in full)"]


def test_a_keep_first_past_the_prompt_runs_it_exact_as_the_plugin_does(tiny_checkpoint, capsys):
    """Inside the context, a keep-first past the prompt is the prompt run in full (exact), on torchfill as
    in the vLLM plugin (whose request rule clamps to the prompt): the same text as --exact, and a note."""
    texts = COMMAND(model=str(tiny_checkpoint), prompt="hi there", split=2, tail=1, keep_first=4000, max_new_tokens=4,
                    compare=True)
    assert texts["filled"] == texts["exact"]
    assert "keep-first 4000 and tail 1 cover the" in capsys.readouterr().err
