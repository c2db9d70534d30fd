"""Side-by-side benchmarks: our trainer vs TRL vs the floor (see README.md)."""
