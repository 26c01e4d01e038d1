"""The demo cluster and its simulated parts: what `proofplane up` runs and nothing else does.

``attester``: the demo's nodes admitted by simulated attesters through the real service path
(marked ``simulated`` wherever they show), re-attesting on a background worker; ``swtpm``: the
few nodes attested instead by real node agents against their own software TPM.
"""
