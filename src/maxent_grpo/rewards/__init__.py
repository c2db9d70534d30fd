"""Reward functions, their registry, and MaxEnt reward statistics."""
