"""OpenSM partitions.conf: what is rendered, the parser (round trip, opensm(8) forms, bad input)."""

from __future__ import annotations

import pytest

import network_scenario as sc
from proofplane.network.desired import NetworkIndex, NodeNet, Segment
from proofplane.network.render.partitions import (
    Member,
    Partition,
    PartitionsSyntaxError,
    default_partition,
    parse_partitions,
    partitions_for,
    render_partitions,
)


def test_the_fabric_partitions() -> None:
    parts = partitions_for(sc.index(), management_guids=["0002:c903:00ff:ff01"])
    default = parts[0]
    assert default == default_partition(sc.MANAGEMENT_GUIDS)
    assert (default.name, default.pkey, default.flags) == ("Default", 0x7FFF, ("ipoib",))
    assert default.members == (Member("ALL", "limited"), Member("SELF", "full"),
                               Member("0x0002c90300ffff01", "full"))  # fmt: skip
    by_name = {p.name: p for p in parts[1:]}
    assert set(by_name) == {"tenant_acme", "tenant_globex", "tenant_initech__i1"}
    acme = by_name["tenant_acme"]
    assert (acme.pkey, acme.flags, acme.defmember) == (1, ("ipoib",), "limited")
    # gpu-a and gpu-b run acme's work: their HCA ports, full members
    assert acme.members == tuple(
        Member(g, "full")
        for g in ("0x0002c90300a1b2c1", "0x0002c90300a1b2c2", "0x0002c90300a1b2d2")
    )
    assert len(by_name["tenant_globex"].members) == 4
    text = render_partitions(parts)
    assert "Default=0x7fff, ipoib : ALL=limited, SELF=full, 0x0002c90300ffff01=full;" in text
    assert (
        "tenant_acme=0x0001, ipoib, defmember=limited : 0x0002c90300a1b2c1=full, "
        "0x0002c90300a1b2c2=full, 0x0002c90300a1b2d2=full;" in text
    )


def test_a_per_workload_partition_name_is_safe() -> None:
    from proofplane.network.render.partitions import partition_name

    assert partition_name("acme") == "tenant_acme"
    assert partition_name("acme", "acme/train-7#3") == "tenant_acme__acme.train-7.3"
    text = render_partitions([Partition(partition_name("acme", "acme/x#1"), 5, ("ipoib",))])
    assert parse_partitions(text)[0].name == "tenant_acme__acme.x.1"


def test_round_trip_with_continuations_and_empty_lists() -> None:
    nodes = [NodeNet(f"n{i}", f"10.250.0.{i}", hca_guids=(f"0x{i:016x}",)) for i in range(1, 12)]
    segs = [Segment("big", 100, 0x10), Segment("idle", 101, 0x11)]
    from proofplane.network.desired import Endpoint, endpoint_mac

    eps = [Endpoint(f"w{i}", "big", f"n{i}", 100, f"10.10.0.{i}", endpoint_mac("big", f"w{i}"))
           for i in range(1, 12)]  # fmt: skip
    parts = partitions_for(NetworkIndex(nodes, segs, {}, eps))
    text = render_partitions(parts)
    assert "\\\n" in text  # 11 members: continued lines
    assert "tenant_idle=0x0011, ipoib, defmember=limited : ;" in text  # no node yet
    assert parse_partitions(text) == parts
    assert render_partitions(parse_partitions(text)) == text


def test_the_forms_of_the_opensm_manual() -> None:
    text = """
# comments and blank lines
Default=0x7fff : ALL, SELF=full ;
Default=0x7fff : ALL, ALL_SWITCHES=full, SELF=full ;
NewPartition , ipoib : 0x123456=full, 0x3456789034=limited, 0x2134af2306 ;
YetAnotherOne = 0x300 : SELF=full ;
YetAnotherOne = 0x300 : ALL=limited ;
ShareIO = 0x80 , defmember=full : 0x123451, 0x123452;
ShareIO = 0x80 , defmember=limited : 0x123459, 0x12345a, 0x12345b=full;  # trailing
Fast=0x10, ipoib, mtu=5, rate=0x7, sl=1, scope=2, Q_Key=0x0b1b, TClass=0, FlowLabel=0 : \\
    ALL_CAS=both, ALL_ROUTERS, NONE;
Spread=0x11 : 0x1,
   0x2=full ;
Empty=0x12 : ;
"""
    parts = parse_partitions(text)
    assert [p.name for p in parts] == ["Default", "Default", "NewPartition", "YetAnotherOne",
                                       "YetAnotherOne", "ShareIO", "ShareIO", "Fast", "Spread",
                                       "Empty"]  # fmt: skip
    assert parts[0].members == (Member("ALL"), Member("SELF", "full"))
    assert parts[2] == Partition(
        "NewPartition", None, ("ipoib",), None,
        (Member("0x0000000000123456", "full"), Member("0x0000003456789034", "limited"),
         Member("0x0000002134af2306")),
    )  # fmt: skip
    assert parts[3].pkey == 0x300 and parts[5].defmember == "full"
    assert parts[7].flags == ("ipoib", "mtu=5", "rate=0x7", "sl=1", "scope=2", "Q_Key=0x0b1b",
                              "TClass=0", "FlowLabel=0")  # fmt: skip
    assert parts[7].members == (Member("ALL_CAS", "both"), Member("ALL_ROUTERS"), Member("NONE"))
    assert parts[8].members == (Member("0x0000000000000001"), Member("0x0000000000000002", "full"))
    assert parts[9].members == ()
    # decimal GUIDs and PKeys too; the full-membership bit of a PKey is dropped
    assert parse_partitions("p=32769 : 291;") == (
        Partition("p", 1, (), None, (Member("0x0000000000000123"),)),
    )


BAD = [
    ("no colon", "tenant_a=0x0001, ipoib 0x1=full;"),
    ("no semicolon", "tenant_a=0x0001 : 0x1=full"),
    ("two colons", "ShareIO = 0x80 : defmember=limited : 0x1;"),
    ("semicolon alone", "a=0x1 : 0x1;;"),
    ("empty name", "=0x0001 : 0x1;"),
    ("bad name", "ten ant=0x0001 : 0x1;"),
    ("pkey text", "a=zz : 0x1;"),
    ("pkey zero", "a=0x0000 : 0x1;"),
    ("pkey 0x8000", "a=0x8000 : 0x1;"),
    ("pkey too big", "a=0x10000 : 0x1;"),
    ("unknown flag", "a=0x1, ipob : 0x1;"),
    ("flag without value", "a=0x1, mtu : 0x1;"),
    ("flag bad value", "a=0x1, mtu=big : 0x1;"),
    ("ipoib with value", "a=0x1, ipoib=1 : 0x1;"),
    ("defmember bad", "a=0x1, defmember=partial : 0x1;"),
    ("empty flag", "a=0x1, , ipoib : 0x1;"),
    ("empty member", "a=0x1 : 0x1, , 0x2;"),
    ("trailing comma", "a=0x1 : 0x1, 0x2,;"),
    ("membership bad", "a=0x1 : 0x1=limi;"),
    ("guid text", "a=0x1 : node7=full;"),
    ("guid too long", "a=0x1 : 0x11112222333344445;"),
    ("keyword prefix", "a=0x1 : AL;"),
    ("mgid groups", "a=0x1 : mgid=ff12:401b::1;"),
    ("continuation at the end", "a=0x1 : 0x1; \\"),
]


@pytest.mark.parametrize(("why", "text"), BAD, ids=[b[0] for b in BAD])
def test_malformed_input_is_refused(why: str, text: str) -> None:
    with pytest.raises(PartitionsSyntaxError) as err:
        parse_partitions("# a file\n\n" + text + "\n")
    assert err.value.code == "invalid_partitions"
    assert err.value.details["line"] == 3
    assert isinstance(err.value, ValueError)


def test_an_empty_file_has_no_partitions() -> None:
    assert parse_partitions("") == () == parse_partitions("# nothing\n\n   \n")
