"""Server side: the ServerApp, central evaluation and the run directory."""
