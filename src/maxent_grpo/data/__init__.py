"""Prompt data below both training and evaluation: datasets (loading, splitting, sampling)
and prompt formatting."""
