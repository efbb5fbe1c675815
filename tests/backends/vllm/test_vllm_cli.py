"""serve's own options against vLLM's command-line parser (no engine started): vLLM's parser takes abbreviations
(`--api-k K` is its --api-key), which is why serve refuses abbreviations of its own options; and no option of vLLM's
is a strict prefix of one of serve's, so that refusal never refuses an option vLLM takes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_options():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return parser, {s for action in parser._actions for s in action.option_strings}


def test_vllm_reads_an_abbreviation_of_api_key_as_the_key(vllm_options):
    parser, _ = vllm_options
    assert parser.parse_known_args(["--model", "m", "--api-k", "s3cret"])[0].api_key == ["s3cret"]


def test_no_vllm_option_is_refused_as_an_abbreviation_of_serves(vllm_options):
    from ridgefill.backends.vllm.args import API_KEY
    from ridgefill.serve.serve import serve_options

    _, names = vllm_options
    own = [*serve_options(), API_KEY]
    assert [(v, o) for v in names for o in own if o.startswith(v) and o != v] == []
    assert API_KEY in names and "--log-file" in own and "--kv-cache-gib" in own
