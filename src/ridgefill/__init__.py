"""RidgeFill: fill upper-layer caches from a closed-form ridge map of the split state."""

__version__ = "0.3.0"
