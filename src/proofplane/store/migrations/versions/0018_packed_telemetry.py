"""Packed telemetry samples (issue 15): one row per device and time instead of one per field
reading.

``telemetry_series`` (one per device, field and holder), ``telemetry_raw`` (one row per
reading) and ``telemetry_latest`` (one row per device and field) become
``telemetry_device_series`` (one per device and holder), ``telemetry_samples`` (one row per
device series and time, one nullable Float column per field) and ``telemetry_device_latest``
(one row per device). A device's 17 readings of an interval are one row, not 17: ingest
writes a row per device, and readers stay plain SQL (``max(prof_gr_engine_active)``).
``telemetry_hourly`` keeps its per-field rows (a 240th of the raw volume; usage, alerts and
FOCUS read it unchanged).

Existing rows are carried over: series are regrouped per device holder (their keys made as
``service.telemetry`` makes them), raw readings are pivoted into samples in SQL (one
``INSERT … SELECT … GROUP BY`` on both databases), the newest readings into one row per
device (its newest time, each field's newest value). The downgrade unpivots them back.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_SEP = "\x1f"

# the fields as of this revision (meter.fields.FIELDS, in order) and their columns
FIELDS = (
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
    "DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES",
)  # fmt: skip
COLUMNS = {f: f.removeprefix("DCGM_FI_").lower() for f in FIELDS}


def _key(*parts: object) -> str:
    return _SEP.join("" if p is None else str(p) for p in parts)


def _field_columns() -> list[sa.Column[Any]]:
    return [sa.Column(c, sa.Float(), nullable=True) for c in COLUMNS.values()]


def _create_packed() -> None:
    op.create_table(
        "telemetry_device_series",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("key", sa.String(length=400), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("seen_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key", name="uq_telemetry_device_series_key"),
    )
    op.create_index("ix_telemetry_device_series_node", "telemetry_device_series", ["node"])
    op.create_index("ix_telemetry_device_series_workload", "telemetry_device_series",
                    ["workload"])  # fmt: skip
    op.create_index("ix_telemetry_device_series_device", "telemetry_device_series",
                    ["gpu_uuid", "gi_id"])  # fmt: skip
    op.create_table(
        "telemetry_samples",
        sa.Column("ts", sa.BigInteger(), nullable=False),  # Unix milliseconds
        sa.Column("series_id", BigId, nullable=False),
        *_field_columns(),
        # time first: an interval's rows append to the same pages; the key is the table
        sa.PrimaryKeyConstraint("ts", "series_id"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "telemetry_device_latest",
        sa.Column("key", sa.String(length=160), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        *_field_columns(),
        sa.PrimaryKeyConstraint("key"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_telemetry_device_latest_node", "telemetry_device_latest", ["node"])


def _create_old() -> None:
    op.create_table(
        "telemetry_series",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("key", sa.String(length=400), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key", name="uq_telemetry_series_key"),
    )
    op.create_index("ix_telemetry_series_node", "telemetry_series", ["node"])
    op.create_index("ix_telemetry_series_workload", "telemetry_series", ["workload"])
    op.create_index("ix_telemetry_series_device", "telemetry_series", ["gpu_uuid", "field"])
    op.create_table(
        "telemetry_raw",
        sa.Column("series_id", BigId, nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("series_id", "ts"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_telemetry_raw_ts", "telemetry_raw", ["ts"])
    op.create_table(
        "telemetry_latest",
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_telemetry_latest_node", "telemetry_latest", ["node"])


def _drop_old() -> None:
    op.drop_index("ix_telemetry_latest_node", table_name="telemetry_latest")
    op.drop_table("telemetry_latest")
    op.drop_index("ix_telemetry_raw_ts", table_name="telemetry_raw")
    op.drop_table("telemetry_raw")
    op.drop_index("ix_telemetry_series_device", table_name="telemetry_series")
    op.drop_index("ix_telemetry_series_workload", table_name="telemetry_series")
    op.drop_index("ix_telemetry_series_node", table_name="telemetry_series")
    op.drop_table("telemetry_series")


def _drop_packed() -> None:
    op.drop_index("ix_telemetry_device_latest_node", table_name="telemetry_device_latest")
    op.drop_table("telemetry_device_latest")
    op.drop_table("telemetry_samples")
    op.drop_index("ix_telemetry_device_series_device", table_name="telemetry_device_series")
    op.drop_index("ix_telemetry_device_series_workload", table_name="telemetry_device_series")
    op.drop_index("ix_telemetry_device_series_node", table_name="telemetry_device_series")
    op.drop_table("telemetry_device_series")


_MAP = sa.table(
    "telemetry_series_map",
    sa.column("old_id", sa.Integer()),
    sa.column("new_id", sa.Integer()),
    sa.column("field", sa.String()),
)


def _create_map() -> None:
    op.create_table(
        "telemetry_series_map",
        sa.Column("old_id", sa.BigInteger(), nullable=False),
        sa.Column("new_id", sa.BigInteger(), nullable=False),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("old_id"),
    )


def upgrade() -> None:
    _create_packed()
    conn = op.get_bind()
    # series: one per device holder; the map says which packed series and column each old
    # (per-field) series becomes
    old = conn.execute(sa.text(
        "SELECT id, node, gpu_uuid, gi_id, profile, field, workload, tenant, share, simulated "
        "FROM telemetry_series ORDER BY id"
    )).all()  # fmt: skip
    new_ids: dict[str, int] = {}
    mapping: list[dict[str, Any]] = []
    series = sa.table(
        "telemetry_device_series", *(sa.column(c) for c in (
            "id", "key", "node", "gpu_uuid", "gi_id", "profile", "workload", "tenant", "share",
            "simulated", "seen_ms")),
    )  # fmt: skip
    for oid, node, uuid, gi, profile, fname, workload, tenant, share, sim in old:
        if fname not in COLUMNS:
            continue
        ident = (node, uuid, gi, profile, workload, tenant, float(share), bool(sim))
        key = _key(*ident)
        if key not in new_ids:
            new_ids[key] = conn.execute(
                sa.insert(series).values(
                    key=key, node=node, gpu_uuid=uuid, gi_id=gi, profile=profile,
                    workload=workload, tenant=tenant, share=float(share), simulated=bool(sim),
                    seen_ms=0,
                ).returning(series.c.id)
            ).scalar_one()  # fmt: skip
        mapping.append({"old_id": oid, "new_id": new_ids[key], "field": fname})
    _create_map()
    if mapping:
        conn.execute(sa.insert(_MAP), mapping)
        cols = ", ".join(COLUMNS.values())
        pivots = ", ".join(
            f"max(CASE WHEN m.field = '{f}' THEN r.value END)" for f in COLUMNS
        )  # fmt: skip
        conn.execute(sa.text(
            f"INSERT INTO telemetry_samples (series_id, ts, {cols}) "
            f"SELECT m.new_id, r.ts, {pivots} FROM telemetry_raw r "
            "JOIN telemetry_series_map m ON m.old_id = r.series_id GROUP BY m.new_id, r.ts"
        ))  # fmt: skip
    op.drop_table("telemetry_series_map")
    conn.execute(sa.text(
        "UPDATE telemetry_device_series SET seen_ms = coalesce((SELECT max(s.ts) FROM "
        "telemetry_samples s WHERE s.series_id = telemetry_device_series.id), 0) / 3600000 "
        "* 3600000"
    ))  # fmt: skip
    # the newest reading per device and field → one row per device
    devices: dict[str, dict[str, Any]] = {}
    for node, uuid, gi, profile, fname, ts, value, workload, tenant, sim in conn.execute(
        sa.text(
            "SELECT node, gpu_uuid, gi_id, profile, field, ts, value, workload, tenant, "
            "simulated FROM telemetry_latest ORDER BY ts"
        )
    ):
        if fname not in COLUMNS:
            continue
        key = f"{node}{_SEP}{uuid}{_SEP}{'' if gi is None else gi}"
        d = devices.setdefault(key, {"key": key, **dict.fromkeys(COLUMNS.values())})
        d.update(node=node, gpu_uuid=uuid, gi_id=gi, profile=profile, ts=ts,
                 workload=workload, tenant=tenant, simulated=bool(sim))  # fmt: skip
        d[COLUMNS[fname]] = value
    if devices:
        latest = sa.table(
            "telemetry_device_latest",
            *(sa.column(c) for c in ("key", "node", "gpu_uuid", "gi_id", "profile", "ts",
                                     "workload", "tenant", "simulated", *COLUMNS.values())),
        )  # fmt: skip
        conn.execute(sa.insert(latest), list(devices.values()))
    _drop_old()


def downgrade() -> None:
    _create_old()
    conn = op.get_bind()
    old = sa.table(
        "telemetry_series", *(sa.column(c) for c in (
            "id", "key", "node", "gpu_uuid", "gi_id", "profile", "field", "workload", "tenant",
            "share", "simulated")),
    )  # fmt: skip
    mapping: list[dict[str, Any]] = []
    rows = conn.execute(sa.text(
        "SELECT id, node, gpu_uuid, gi_id, profile, workload, tenant, share, simulated "
        "FROM telemetry_device_series ORDER BY id"
    )).all()  # fmt: skip
    for sid, node, uuid, gi, profile, workload, tenant, share, sim in rows:
        for f in FIELDS:
            key = _key(node, uuid, gi, profile, f, workload, tenant, float(share), bool(sim))
            oid = conn.execute(
                sa.insert(old).values(
                    key=key, node=node, gpu_uuid=uuid, gi_id=gi, profile=profile, field=f,
                    workload=workload, tenant=tenant, share=float(share), simulated=bool(sim),
                ).returning(old.c.id)
            ).scalar_one()  # fmt: skip
            mapping.append({"old_id": oid, "new_id": sid, "field": f})
    _create_map()
    if mapping:
        conn.execute(sa.insert(_MAP), mapping)
        for f, c in COLUMNS.items():
            conn.execute(sa.text(
                "INSERT INTO telemetry_raw (series_id, ts, value) "
                f"SELECT m.old_id, s.ts, s.{c} FROM telemetry_samples s "
                "JOIN telemetry_series_map m ON m.new_id = s.series_id "
                f"WHERE m.field = '{f}' AND s.{c} IS NOT NULL"
            ))  # fmt: skip
        # a series no reading names is left out, as retention would drop it
        conn.execute(sa.text(
            "DELETE FROM telemetry_series WHERE NOT EXISTS "
            "(SELECT 1 FROM telemetry_raw r WHERE r.series_id = telemetry_series.id)"
        ))  # fmt: skip
    op.drop_table("telemetry_series_map")
    latest_old = sa.table(
        "telemetry_latest", *(sa.column(c) for c in (
            "key", "node", "gpu_uuid", "gi_id", "profile", "field", "ts", "value", "workload",
            "tenant", "simulated")),
    )  # fmt: skip
    cols = ", ".join(COLUMNS.values())
    out = []
    for row in conn.execute(sa.text(
        "SELECT node, gpu_uuid, gi_id, profile, ts, workload, tenant, simulated, "
        f"{cols} FROM telemetry_device_latest"
    )):  # fmt: skip
        node, uuid, gi, profile, ts, workload, tenant, sim = row[:8]
        for f, value in zip(FIELDS, row[8:], strict=True):
            if value is not None:
                out.append({
                    "key": f"{uuid}{_SEP}{'' if gi is None else gi}{_SEP}{f}", "node": node,
                    "gpu_uuid": uuid, "gi_id": gi, "profile": profile, "field": f, "ts": ts,
                    "value": value, "workload": workload, "tenant": tenant,
                    "simulated": bool(sim),
                })  # fmt: skip
    if out:
        conn.execute(sa.insert(latest_old), out)
    _drop_packed()
