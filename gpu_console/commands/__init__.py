"""Commands with more than a few lines behind them; ``cli.py`` imports each lazily."""
