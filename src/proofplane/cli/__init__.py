"""The ``proofplane`` command line: server commands (serve, up, db) and API client commands."""
