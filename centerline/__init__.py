"""centerline: off-policy RL with score centering. The console script lives in `cli.py`."""
