"""The node agent's side of the house: the I/O a node performs to prove itself.

``agent.tpm`` drives the TPM through tpm2-tools (``tpm2tools``) and, for tests and the demo,
manufactures and runs software TPMs (``swtpm``). The pure checks of what these tools produce
live in :mod:`proofplane.attest`.
"""
