"""Run safety: the output directory's lock and its earlier runs (directory.py), atomic files (files.py), stop signals
(signals.py), and the one-line messages of failures (failures.py)."""
