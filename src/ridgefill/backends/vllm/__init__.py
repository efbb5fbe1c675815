"""vLLM, whole: the backend behind the seam (backend.py), its measurement worker (worker.py: one vLLM engine in a
child process), the start-up checks and the reading of vLLM's configuration (config.py), vLLM's options as serve
reads them (args.py), the fill's translation for the plugin (fill.py), requests' own options (requests.py), the
allocator policy of its processes (malloc.py), the KV cache's size on a CPU build (kv_sizing.py), how vLLM serves
(server.py), the vLLM parts of the request guard (middleware.py), and the code that runs inside vLLM's processes
(plugin/, loaded through the vllm.general_plugins entry point). No module outside this folder imports vllm."""
