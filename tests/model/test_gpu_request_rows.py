"""The GPU request has one mapping to the workload table's columns (``to_row``/``from_row``)
and one to the API's body (``GpuRequestIO.to_domain``/``from_domain``); the limits the API and
the service both enforce (batch size, name pattern) are one constant each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from proofplane.access import SYSTEM
from proofplane.api.schemas import GpuRequestIO, Name, WorkloadBatchIn
from proofplane.errors import ValidationFailed
from proofplane.model import GpuRequest, validate_name
from proofplane.model.tags import NAME_PATTERN
from proofplane.model.workload import MAX_BATCH, MAX_SKU_CHARS
from proofplane.service import workloads as workloads_svc
from proofplane.store.tables import WorkloadRow

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
# no body carries a NUL or a lone surrogate (JSON text is Unicode: pydantic refuses one, so
# no request could), nor a model or MIG profile name longer than the API's bound
SKU = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=MAX_SKU_CHARS,
)
requests = st.builds(
    GpuRequest,
    count=INT32,
    model=st.none() | SKU,
    mig_profile=st.none() | st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]) | SKU,
    share_milli=st.none() | INT32,
    nodes=INT32,
)


@given(requests)
def test_row_round_trip_through_a_mapping(g: GpuRequest) -> None:
    assert GpuRequest.from_row(g.to_row()) == g


@given(requests)
def test_row_round_trip_through_an_object_with_the_columns(g: GpuRequest) -> None:
    assert GpuRequest.from_row(SimpleNamespace(**g.to_row())) == g


@given(requests)
def test_api_body_round_trip(g: GpuRequest) -> None:
    assert GpuRequestIO.from_domain(g).to_domain() == g


def test_the_row_keys_are_the_workload_tables_columns() -> None:
    columns = set(WorkloadRow.__table__.columns.keys())
    row = GpuRequest(2, "H100-SXM5-80GB", None, None, 2).to_row()
    assert set(row) <= columns
    assert set(row) == {"gpu_count", "gpu_model", "mig_profile", "share_milli", "gpu_nodes"}
    assert GpuRequest.from_row(WorkloadRow(**row)) == GpuRequest(2, "H100-SXM5-80GB", None, None, 2)


def test_a_row_missing_a_column_is_an_error_not_a_default() -> None:
    row = GpuRequest().to_row()
    del row["gpu_nodes"]
    with pytest.raises(KeyError):
        GpuRequest.from_row(row)


def test_the_batch_bound_is_one_constant() -> None:
    # the service refuses one item over the bound before it reads anything (no store needed)
    with pytest.raises(ValidationFailed) as refused:
        workloads_svc.submit_workloads(None, SYSTEM, [None] * (MAX_BATCH + 1))  # type: ignore[arg-type, list-item]
    assert refused.value.code == "batch_too_large"
    assert refused.value.details == {"items": MAX_BATCH + 1, "max": MAX_BATCH}
    bound = WorkloadBatchIn.model_fields["items"].metadata
    assert any(getattr(m, "max_length", None) == MAX_BATCH for m in bound)
    assert f"up to {MAX_BATCH} workloads" in (
        WorkloadBatchIn.model_fields["items"].description or ""
    )


@pytest.mark.parametrize(
    "name", ["a", "gpu-node-1", "a" * 63, "", "A", "1abc", "abc-", "a" * 64, "a_b", "a.b", "ab\n"]
)
def test_the_api_and_the_model_agree_on_names(name: str) -> None:
    try:
        validate_name(name, "node")
        model_ok = True
    except ValidationFailed:
        model_ok = False
    try:
        TypeAdapter(Name).validate_python(name)
        api_ok = True
    except ValidationError:
        api_ok = False
    assert model_ok == api_ok
    assert NAME_PATTERN.startswith("^") and NAME_PATTERN.endswith("$")
