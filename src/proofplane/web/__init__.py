"""The web console (issue 16): pages for people, served by the API server at ``/``."""
