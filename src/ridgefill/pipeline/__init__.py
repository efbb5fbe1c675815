"""Recipes as one cached pipeline: recipe (TOML and KEY=VALUE overrides → validated step tables), plan (the
sweep's tasks), run (cache keys, running the tasks; `ridgefill run` and `ridgefill demo`), manifest."""
