"""Measurements: one module per evaluation."""
