"""Where genfast keeps things: its home directory, downloaded models, files written whole."""
