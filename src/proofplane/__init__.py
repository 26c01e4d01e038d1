"""proofplane: the control plane for bare-metal GPU clusters that run regulated AI work.

The public surface is small on purpose: the error hierarchy (what every caller may catch) and
the version. Everything else is reached through the API, the CLI or the service layer.
"""

from proofplane.errors import (
    Conflict,
    InvalidState,
    NotFound,
    ProofplaneError,
    ValidationFailed,
)

__version__ = "0.1.0"

__all__ = [
    "Conflict",
    "InvalidState",
    "NotFound",
    "ProofplaneError",
    "ValidationFailed",
    "__version__",
]
