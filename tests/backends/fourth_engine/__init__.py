"""A fourth engine for the tests (tests/backends/test_fourth_engine.py): its folder and one line in the registry
(backends.ENGINES, monkeypatched by the test) are all it takes."""
