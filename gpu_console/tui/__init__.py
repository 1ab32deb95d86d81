"""The Textual console: launch screen, run screen, runs screen (no torch here).

- :mod:`.app`: the App, its keys and screen wiring;
- :mod:`.feed`: a run directory folded into what the run screen shows (a worker thread runs it);
- :mod:`.reader`: reading big ``events.jsonl`` files fast (the tail in full, the rest sampled);
- :mod:`.series`: bounded, downsampled chart series;
- :mod:`.screens` and :mod:`.widgets`: what is drawn; :mod:`.messages`: what workers post.
"""
