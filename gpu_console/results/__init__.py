"""Readers of a run that write its results elsewhere (TensorBoard today); no torch here."""
