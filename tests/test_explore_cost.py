"""Cost and energy: the packaged price table's sources and coverage, the formulas, user price files."""

from __future__ import annotations

import math
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.errors import DataError
from simulator.explore.cost import (
    DEFAULT_FIELDS, DEVICE_FIELDS, NODE_FIELDS, ClusterShape, Pricing, busy_fraction, check_prices, cluster_power_w,
    load_prices, missing_prices, packaged_prices_path, per_million_tokens, token_budget,
)
from simulator.hardware.catalog import get_device
from simulator.network.topology import list_topologies, load_topology

DGX_H100_X2 = ClusterShape("h100-sxm", 700.0, "dgx-h100", 2, 16)


def test_every_packaged_number_has_a_source_and_a_date():
    document = tomllib.loads(packaged_prices_path().read_text(encoding="utf-8"))
    tables = [("defaults", document["defaults"], DEFAULT_FIELDS)]
    tables += [(f"devices.{n}", t, DEVICE_FIELDS) for n, t in document["devices"].items()]
    tables += [(f"nodes.{n}", t, NODE_FIELDS) for n, t in document["nodes"].items()]
    for where, table, fields in tables:
        for field in fields:
            if field in table:
                assert len(table.get(f"{field}_source", "")) > 20, f"{where}.{field} has no source"
                date = table.get(f"{field}_date", "")
                assert len(date) == 10 and date[4] == date[7] == "-", f"{where}.{field}: date {date!r}"


def test_every_bundled_topology_can_be_rented_and_powered():
    table = load_prices()
    for name in list_topologies():
        topology = load_topology(name)
        shape = ClusterShape(topology.gpu_device.name, topology.gpu_device.tdp_w, name, 1, topology.num_gpus)
        assert missing_prices(table, shape, Pricing("rent")) == [], name
        single = ClusterShape(shape.device, shape.tdp_w, None, 1, 1)
        assert missing_prices(table, single, Pricing("own")) == [], name   # one GPU: its purchase price
    owned = {name: missing_prices(table, ClusterShape(load_topology(name).gpu_device.name, 1.0, name, 1, 8),
                                  Pricing("own")) for name in list_topologies()}
    # servers with no published price: owning them needs a --prices file (the message says so)
    assert {name for name, missing in owned.items() if missing} == {"hgx-h200", "pcie-4x4090", "pcie-8xa100", "workstation-rtx4090"}


def test_power_and_dollars_by_hand():
    table = load_prices()
    # 16 GPUs at 105 W idle, 700 W TDP, half busy; 2 servers at 4,600 W; PUE 1.58
    power = 1.58 * (16 * (105 + (700 - 105) * 0.5) + 2 * 4600)
    assert math.isclose(cluster_power_w(table, DGX_H100_X2, 0.5), power, rel_tol=1e-12)
    usd, kwh = per_million_tokens(table, DGX_H100_X2, Pricing("rent"), 1e5, 0.5)     # 10 s per million tokens
    assert math.isclose(usd, 16 * 2.99 / 3600 * 10, rel_tol=1e-12)
    assert math.isclose(kwh, power * 10 / 3.6e6, rel_tol=1e-12)
    owned, _ = per_million_tokens(table, DGX_H100_X2, Pricing("own", 4.0), 1e5, 0.5)
    expected = (2 * 270000 / (4 * 365.25 * 86400) + power / 1000 * 0.0895 / 3600) * 10
    assert math.isclose(owned, expected, rel_tol=1e-12)
    default_years, _ = per_million_tokens(table, DGX_H100_X2, Pricing("own"), 1e5, 0.5)    # the table's 5 years
    expected = (2 * 270000 / (5 * 365.25 * 86400) + power / 1000 * 0.0895 / 3600) * 10
    assert math.isclose(default_years, expected, rel_tol=1e-12)
    budget = token_budget(1e12, 1e5, usd, kwh)
    assert (budget.time_s, budget.usd, budget.kwh) == (1e7, usd * 1e6, kwh * 1e6)


@given(st.floats(0, 1), st.floats(0, 1))
def test_power_rises_with_utilisation_between_idle_and_busy(low, high):
    table = load_prices()
    low, high = sorted((low, high))
    idle, busy = cluster_power_w(table, DGX_H100_X2, 0.0), cluster_power_w(table, DGX_H100_X2, 1.0)
    assert idle <= cluster_power_w(table, DGX_H100_X2, low) <= cluster_power_w(table, DGX_H100_X2, high) <= busy
    assert math.isclose(busy, 1.58 * (16 * 700 + 2 * 4600), rel_tol=1e-12)


def test_busy_fraction_is_the_mean_compute_share():
    report = {"iteration_time_s": 2.0, "ranks": [{"compute_s": 1.0}, {"compute_s": 1.5}]}
    assert busy_fraction(report) == 0.625
    assert busy_fraction({"iteration_time_s": 0.0, "ranks": [{"compute_s": 1.0}]}) == 0.0


def test_a_user_file_replaces_fields_and_keeps_the_rest(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[defaults]\npue = 1.1\n[devices.h100-sxm]\nrent_usd_per_gpu_hour = 1.99\n'
                    'rent_usd_per_gpu_hour_source = "our contract"\n[nodes.hgx-h200]\npurchase_usd = 300000\n',
                    encoding="utf-8")
    table = load_prices(path)
    assert table.defaults["pue"] == 1.1 and table.defaults["amortization_years"] == 5.0
    assert table.devices["h100-sxm"]["rent_usd_per_gpu_hour"] == 1.99
    assert table.devices["h100-sxm"]["purchase_usd"] == 27500.0
    assert table.sources["devices.h100-sxm.rent_usd_per_gpu_hour"] == "our contract (undated)"
    check_prices(table, [ClusterShape("h200-sxm", 700.0, "hgx-h200", 1, 8)], Pricing("own"))


@pytest.mark.parametrize(("text", "message"), [
    ('format = "x"\n', "format = 'x': must be 'memsim-prices-1'"),
    ("[device.h100-sxm]\nidle_w = 1\n", "device: unknown key; did you mean 'devices'?"),
    ("[devices.h100-sxm]\nidle = 1\n", "devices.h100-sxm.idle: unknown key; did you mean 'idle_w'?"),
    ("[devices.h100]\nidle_w = 1\n", "devices.h100: not a device of the catalog; did you mean 'h100-sxm'?"),
    ("[defaults]\npue = 0.9\n", "defaults.pue = 0.9: must be a number >= 1"),
    ('[nodes.dgx-a100]\noverhead_w = "3 kW"\n', "nodes.dgx-a100.overhead_w = '3 kW': must be a number > 0"),
    ("[devices.rtx-4090]\nidle_w = 1\nidle_w_source = 3\n", "idle_w_source = 3: must be a string"),
    ("[defaults\n", "not a readable price table"),
])
def test_bad_price_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as refused:
        load_prices(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_device_without_prices_is_refused_with_the_key_to_add():
    table = load_prices()
    cpu = ClusterShape("cpu", get_device("cpu").tdp_w, None, 1, 1)
    with pytest.raises(DataError, match=r"devices\.cpu\.idle_w is missing \(the idle power of one GPU, needed for "
                                        r"energy on cpu\): add it in a --prices file"):
        check_prices(table, [cpu], Pricing("rent"))
    with pytest.raises(DataError, match=r"nodes\.pcie-8xa100\.purchase_usd is missing \(the purchase price, needed "
                                        r"for pricing = 'own' on pcie-8xa100\)"):
        check_prices(table, [ClusterShape("a100-80gb-pcie", 300.0, "pcie-8xa100", 1, 8)], Pricing("own"))
