"""Sweeps: many runs of one base profile, placed on a machine's devices as they free up.

``spec``: the sweep file, checked in full before anything starts; ``trials``: the trials a
search makes (grid, random); ``slots``: the granted devices cut into trials' shares;
``store``: the sweep's directory (its plan, its events, the console's commands, the trials'
runs); ``driver``: the detached process that starts, watches, prunes and resumes the trials;
``study``: the sweep's Optuna study, where Optuna is installed; ``follow``: the headless
console's lines and final table. No torch.
"""
