"""Widgets of the run and launch screens; each draws from a snapshot, none reads files."""
