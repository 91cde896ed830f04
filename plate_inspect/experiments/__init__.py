"""Experiments: the continual-learning benchmark and its data sets."""
