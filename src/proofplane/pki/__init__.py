"""Certificates proofplane issues and checks: the API's TLS files (``pki.tls``)."""
