"""The pure renderers (``proofplane.network.render``) as the services use them: a node's desired
state in each format the API serves, and the hash of the ruleset its agent must run."""

from __future__ import annotations

from proofplane.network.desired import NetworkIndex, NodeDesired
from proofplane.network.render.iproute2 import render_iproute2
from proofplane.network.render.nftables import render_nftables, ruleset_sha256
from proofplane.network.render.partitions import partitions_for, render_partitions

FORMATS = ("json", "iproute2", "nftables", "partitions")
TEXT_FORMATS = ("iproute2", "nftables", "partitions")


# Ruleset hashes by the desired state's own SHA-256, which covers everything the ruleset is
# rendered from (``desired_sha256``): a node's state recurs (a workload placed and cancelled
# gives back the state before it), and each new generation rendered its ruleset again under
# the write lock (issue 20). Bounded: emptied when full.
_RULESETS: dict[str, str] = {}
_RULESETS_MAX = 4096


def expected_ruleset_sha256(d: NodeDesired) -> str:
    """SHA-256 of the nftables ruleset rendered for ``d``: what the node's agent reports as its
    ``ruleset_sha256`` once that ruleset is loaded."""
    known = _RULESETS.get(d.sha256)
    if known is None:
        known = ruleset_sha256(render_nftables(d))
        if len(_RULESETS) >= _RULESETS_MAX:
            _RULESETS.clear()
        _RULESETS[d.sha256] = known
    return known


def render_text(d: NodeDesired, fmt: str, index: NetworkIndex, generation: int) -> str:
    """``d`` as text: ``iproute2`` (the ``ip -batch`` then the ``bridge -batch`` lines that
    build it on a node that carries none of it yet), ``nftables`` (the ruleset, loaded with
    ``nft -f``), ``partitions`` (OpenSM ``partitions.conf`` for the segments on the node, their
    members the HCA port GUIDs of the nodes holding them; ``index`` holds those nodes)."""
    if fmt == "nftables":
        return render_nftables(d)
    if fmt == "partitions":
        return render_partitions(partitions_for(index))
    ip, bridge = render_iproute2(d)
    head = f"# proofplane: node {d.node}, generation {generation}, sha256 {d.sha256}\n"
    return f"{head}# ip -batch -\n{ip}# bridge -batch -\n{bridge}"
