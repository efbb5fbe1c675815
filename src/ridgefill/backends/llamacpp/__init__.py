"""ridgefill's fill inside llama.cpp: the patch (ridgefill.patch), its build (build.py) and its driver (driver.py)."""
