"""Token ids a client sends, checked where vLLM 0.32 does not: `/detokenize` turns an id outside the vocabulary into
an empty text with a 200 (a prompt's ids vLLM checks itself). The patch that calls this: patches.DetokenizePatch."""

from __future__ import annotations

from ridgefill.backends.vllm.plugin.private import bad_request, vocab_size


async def checked_detokenize(original, serving, request, raw_request):
    """vLLM's create_detokenize, after a 400 for the first id outside 0..vocabulary - 1."""
    size = vocab_size(serving)
    bad = next((t for t in request.tokens if not 0 <= t < size), None)
    if bad is not None:
        return bad_request(serving, f"token id {bad} is outside the vocabulary (0..{size - 1}): send ids of this "
                                    "model's tokenizer")
    return await original(serving, request, raw_request)
