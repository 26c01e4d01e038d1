"""Renderers of a node's desired network state (pure): iproute2, nftables, OpenSM."""
