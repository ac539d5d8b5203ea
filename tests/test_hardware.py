"""The hardware layer: measured tables, NCCL's collectives across hosts, the transports, and
`codesign hardware`, held to published measurements (tests/published_hardware.py)."""

from __future__ import annotations

import csv
import io
import statistics

import pytest

from codesign.cli import hardware as hardware_cli
from codesign.config.types import ClusterSpec, TRANSPORTS
from codesign.hardware import collectives, tables
from codesign.hardware.device import Devices
from codesign.hardware.gemm import DATA_SHEET, gemm_seconds
from codesign.hardware.links import LINKS, cluster_links
from codesign.hardware.profiles import BUILTIN
from tests import published_hardware as published
from tests.conftest import REPO, run_cli

needs_tables = pytest.mark.skipif(tables.table("H100") is None, reason="aiconfigurator-core is not installed")
ROWS = published.COLLECTIVES + published.GEMMS


def ratio(row) -> float:
    return published.predicted(row) / row.seconds


@needs_tables
def test_at_least_nine_in_ten_published_rows_lie_inside_their_bands():
    assert len(ROWS) >= 20 and len({r.id for r in ROWS}) == len(ROWS)
    inside = [r.band[0] <= ratio(r) <= r.band[1] for r in ROWS]
    assert sum(inside) >= 0.9 * len(ROWS), [r.id for r, ok in zip(ROWS, inside) if not ok]


@needs_tables
def test_large_messages_and_gemms_are_priced_within_15_percent_at_the_median():
    large = [abs(ratio(r) - 1) for r in published.COLLECTIVES if r.nbytes >= 64 * published.MiB]
    gemms = [abs(ratio(r) - 1) for r in published.GEMMS]
    assert statistics.median(large) <= 0.15 and statistics.median(gemms) <= 0.15


@needs_tables
def test_the_docs_page_shows_every_row_as_the_model_prices_it():
    assert published.markdown() in (REPO / "docs" / "hardware.md").read_text()


def devices(device: str, hosts: int, per_host: int, transport: str) -> Devices:
    cluster = ClusterSpec(hosts, per_host, transport, "sim", device)
    return Devices.of(BUILTIN[device], cluster, *cluster_links(BUILTIN[device], cluster))


@needs_tables
@pytest.mark.parametrize("device, transport", [("H100", "NDRx8"), ("H100", "EFAx32"), ("A100", "HDRx8")])
def test_an_all_reduce_across_hosts_keeps_its_bus_bandwidth_from_16_to_128_gpus(device, transport):
    times = [devices(device, hosts, 8, transport).collective("all-reduce", 2**30, hosts, 8) for hosts in (2, 4, 8, 16)]
    assert times == sorted(times) and times[-1] <= 1.2 * times[0]


@needs_tables
def test_small_collectives_grow_with_the_log_of_the_hosts_not_with_them():
    small = [devices("H100", hosts, 8, "NDRx8").collective("all-reduce", 8192, hosts, 8) for hosts in (2, 4, 8, 16)]
    steps = [b - a for a, b in zip(small, small[1:])]
    assert all(0 < b <= a * 1.05 for a, b in zip(steps, steps[1:])) and small[-1] < 2 * small[0]  # per doubling


@needs_tables
def test_across_hosts_the_slower_of_nvlink_and_the_nics_bounds_not_their_sum():
    hw = devices("H100", 2, 8, "NDRx8")
    inside = hw.within_host("all-reduce", 2**30, 8)
    network = collectives.bus_factor("all-reduce", 16) * 2**30 / (2 * LINKS["NDRx8"].link.bandwidth)  # 2 hosts
    across = hw.collective("all-reduce", 2**30, 2, 8) - collectives.LAUNCH - hw.inter.latency * 2
    assert across == pytest.approx(max(inside * collectives.bus_factor("all-reduce", 16) / 1.75, network))
    assert across < inside + network


@needs_tables
def test_the_table_is_read_in_its_units():
    """NCCL rows count elements of their dtype (half: 2 bytes), latencies are milliseconds: the
    8-GPU all-reduce of 512 MiB reaches nccl-tests' published ~445-480 GB/s bus bandwidth."""
    size, seconds = tables.table("H100").nccl.curves["all-reduce", 8]
    assert size[-1] == 512 * 2**20 and size[0] == 512
    assert 400e9 < 1.75 * size[-1] / seconds[-1] < 500e9
    grid = tables.table("H100").gemm
    m, n, k = (list(a).index(4096) for a in (grid.m, grid.n, grid.k))
    assert 700e12 < 2 * 4096 ** 3 / grid.seconds[m, n, k] < 850e12


@needs_tables
def test_gemms_interpolate_in_log_space_and_grow_with_flops_past_the_grid():
    small, _ = gemm_seconds("H100", "bf16", 1024, 1024, 1024)
    between, _ = gemm_seconds("H100", "bf16", 1536, 1024, 1024)
    large, _ = gemm_seconds("H100", "bf16", 2048, 1024, 1024)
    assert small < between < large
    top = int(tables.table("H100").gemm.m[-1])
    edge, _ = gemm_seconds("H100", "bf16", top, 4096, 4096)
    past, _ = gemm_seconds("H100", "bf16", 4 * top, 4096, 4096)
    assert past == pytest.approx(4 * edge)
    tiny, _ = gemm_seconds("H100", "bf16", 1, 8, 8)
    assert tiny == pytest.approx(gemm_seconds("H100", "bf16", 1, 32, 32)[0])  # the floor below the grid
    fp32, source = gemm_seconds("H100", "fp32", 4096, 4096, 4096)
    assert fp32 == pytest.approx(989 / 495 * gemm_seconds("H100", "bf16", 4096, 4096, 4096)[0]) and "TF32" in source


def test_a_device_without_a_table_prices_from_its_data_sheet_and_says_so(monkeypatch):
    monkeypatch.setattr(tables, "table", lambda kind: None)
    monkeypatch.setattr("codesign.hardware.gemm.table", lambda kind: None)
    seconds, source = gemm_seconds("H100", "bf16", 4096, 4096, 4096)
    assert source == DATA_SHEET and seconds == pytest.approx(2 * 4096 ** 3 / (0.5 * 989e12))


def test_every_transport_has_its_figures_and_the_loader_lists_them_all(tmp_path):
    assert set(LINKS) == set(TRANSPORTS) and {"NDRx8", "HDRx8", "EFAx32", "EFAx4", "TCPx4"} <= set(TRANSPORTS)
    config = tmp_path / "c.toml"
    config.write_text("[training_spec]\navg_batch_size_per_device = 8\nnum_iters = 2\n[[model]]\nnum_features = 8\n"
                      "emb_dim = 4\noutput_per_emb = 2\nnum_zhen_layers = 1\ntokens = [\"LINEAR\"]\n"
                      "[[cluster_spec]]\nnum_hosts = 2\nnum_devices_per_host = 8\ntransport = \"IB\"\n"
                      "platform = \"sim\"\ndevice = \"H100\"\n[[parallel_spec]]\ndescription = \"data parallel\"\n"
                      "num_micro_batches = [1]\n\"(pp, dp, op)\" = [1, 16, 1]\n")
    proc = run_cli("--dry-run", "-c", str(config), cwd=tmp_path)
    assert proc.returncode == 2 and all(name in proc.stderr for name in TRANSPORTS), proc.stderr


def test_hardware_collectives_lists_both_groups_of_every_cluster_at_every_size(tmp_path):
    rows = list(csv.DictReader(io.StringIO(cli("collectives", "-c", str(REPO / "bench" / "plan_sim.toml"),
                                                "--sizes", "1KiB,1MiB,1GiB", "--format", "csv", cwd=tmp_path))))
    assert list(rows[0]) == list(hardware_cli.COLLECTIVE_COLUMNS)
    assert len(rows) == 4 * 3 * (1 + 2 + 2)  # collectives x sizes x groups (1x8: one; 2x8 and 8x8: two each)
    assert {r["bytes"] for r in rows} == {"1024", "1048576", "1073741824"}
    eight = [r for r in rows if r["cluster"].startswith("8x8") and r["hosts"] == "8"]
    assert {r["devices"] for r in eight} == {"64"} and all(float(r["busbw_gbps"]) > 0 for r in eight)
    first = next(r for r in rows if r["collective"] == "all-reduce" and r["bytes"] == "1073741824")
    assert float(first["busbw_gbps"]) == pytest.approx(1.75 * 2**30 / float(first["seconds"]) / 1e9)


def test_hardware_gemm_prices_each_shape_and_refuses_a_device_it_cannot(tmp_path):
    rows = list(csv.DictReader(io.StringIO(cli("gemm", "--device", "H100", "--shapes", "4096x4096x4096,1024x512x256",
                                                "--format", "csv", cwd=tmp_path))))
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [("4096", "4096", "4096"), ("1024", "512", "256")]
    assert float(rows[0]["tflops"]) == pytest.approx(2 * 4096 ** 3 / float(rows[0]["seconds"]) / 1e12)
    bad = run_cli("hardware", "gemm", "--device", "TPU", "--shapes", "8x8x8", cwd=tmp_path)
    assert bad.returncode == 2 and "TPU" in bad.stderr and not list(tmp_path.iterdir())
    assert run_cli("hardware", "gemm", "--device", "H100", "--shapes", "8x8", cwd=tmp_path).returncode == 2


def test_hardware_sizes_take_suffixes():
    assert hardware_cli.sizes("1024,64KiB,1MiB,8GiB") == (1024, 64 * 2**10, 2**20, 8 * 2**30)
    assert hardware_cli.DEFAULT_SIZES[0] == 1024 and hardware_cli.DEFAULT_SIZES[-1] == 8 * 2**30


def test_hardware_summarises_each_cluster(tmp_path):
    out = cli("-c", str(REPO / "bench" / "plan_sim.toml"), cwd=tmp_path)
    lines = out.splitlines()
    assert lines[0].split() == list(hardware_cli.SUMMARY_COLUMNS) and len(lines) == 4
    assert "EFAx4" in lines[2] and "H100" in lines[1]


def cli(*args: str, cwd) -> str:
    proc = run_cli("hardware", *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
