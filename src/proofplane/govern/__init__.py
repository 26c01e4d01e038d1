"""Governance: change control with approvals and separation of duties (``changes``), pure."""
