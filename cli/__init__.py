"""The `conveyor` command (cli/main.py): the top layer, above the HTTP server (web/) and the engine (pipeline/)."""
