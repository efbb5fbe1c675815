"""ridgefill's fill inside llama.cpp: the patches (patches/), their builds (build.py: the wheel and llama-server), the
driver (driver.py) and the server behind serve (server.py, app.py)."""
