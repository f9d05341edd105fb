"""feedrate's Hydra launcher: one fresh, time-limited process per job."""
