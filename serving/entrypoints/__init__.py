"""Entry points: the servers and command line over the engine (the core never imports them)."""
