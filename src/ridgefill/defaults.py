"""Defaults that several layers share and that must be read without importing torch (the recipe parser reads them
before any model loads): each is written here once."""

DEFAULT_CHUNK = 2048  # prompt rows run at once (bounds activation memory): every command's and lm-eval's default
DEFAULT_TAIL = 256  # last prompt rows that run the full model: the fill's default tail and the recipe's
DEFAULT_KEEP_FIRST = 1  # leading prompt rows that run in full (the attention sink)
