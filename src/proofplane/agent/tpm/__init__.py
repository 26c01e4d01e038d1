"""TPM I/O for the node agent: tpm2-tools subprocesses and software TPMs (swtpm)."""
