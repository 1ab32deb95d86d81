"""Screens: launch (pick and start), run (watch and control), runs (pick a run), modals."""
