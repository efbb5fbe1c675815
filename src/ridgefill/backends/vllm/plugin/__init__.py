"""The code of ridgefill's vLLM plugin that runs inside vLLM's processes: the patches it applies to vLLM (patch.py,
patches.py, one list) and the private vLLM state it reads (private.py, one adapter), each checked at start-up."""
