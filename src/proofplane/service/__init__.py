"""Application services: one function per use case, one transaction per call.

Each function checks authorization, loads state, calls the pure core, persists and records its
events in the same transaction. API and CLI call these and nothing below them.
"""
