"""KMS backends: where the key material lives and the operations done with it.

``Backend`` is the one interface: ``generate`` makes one key version's material and returns an
opaque handle (stored in the key inventory); ``wrap``/``unwrap`` protect a data key under an
``encrypt`` version; ``sign``/``public_key`` use a ``sign`` version (Ed25519); ``check`` says
whether the backend can be used now. Backends, chosen by ``PROOFPLANE_KMS``:

* ``local`` (:mod:`proofplane.kms.local`): an embedded keyring, each version's material sealed
  under the master key in ``PROOFPLANE_MASTER_KEY_FILE``;
* ``pkcs11`` (:mod:`proofplane.kms.pkcs11`): keys generated in an HSM token, never extractable;
* ``openbao`` (:mod:`proofplane.kms.openbao`): OpenBao/Vault transit.
"""

from proofplane.kms.backend import Backend, backend_from_env

__all__ = ["Backend", "backend_from_env"]
