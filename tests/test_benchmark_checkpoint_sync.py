"""benchmarks/checkpoint_sync.py's arithmetic, without I/O: the JSON object (keys, the
XFS's nulls), the targets, the table, the XFS image's size and why it cannot be made."""


import pytest

KEYS = {"model_bytes", "default_fs", "changed_bytes", "written_bytes", "speedup_vs_seed",
        "speedup_vs_full", "scattered_speedup_vs_full", "nochange_gbps", "hash_gbps",
        "nochange_vs_hash", "named_speedup_vs_seed", "named_speedup_vs_full",
        "watched_speedup_vs_seed", "watched_speedup_vs_full", "ext4_rows_speedup_vs_full",
        "xfs_rows_speedup_vs_full", "xfs_written_bytes", "xfs_speedup_vs_seed",
        "xfs_named_speedup_vs_seed", "xfs_scattered_speedup_vs_full", "xfs_nochange_vs_hash",
        "xfs_rows_ceiling_vs_full", "watch_write_cost", "skipped"}


@pytest.fixture
def bench(load_bench):
    return load_bench("checkpoint_sync")


def rows(hotweights: float, how: str) -> dict:
    """Every scenario alike: seed 1 s, full 2 s, named and watched 0.05 s."""
    seconds = dict(hotweights=hotweights, watched=0.05, named=0.05, seed=1.0, full=2.0)
    return {sc: dict(changed=1000, elements=500, seconds=seconds,
                     written=dict(hotweights=1050, watched=1000, named=1000, seed=4096,
                                  full=10**6),
                     how=dict(hotweights=how, watched=how, named=how),
                     hashed=dict(hotweights=10**6, watched=10, named=100))
            for sc in "abcd"}


def test_summary_without_xfs_has_every_key_and_its_xfs_keys_null(bench):
    out = bench.summary(10**9, 20.0, "ext4", rows(0.5, "2 whole"), None, (0.3, 0.1),
                        {"xfs": "loop-mounting an XFS needs root"})
    assert set(out) == KEYS
    assert out["default_fs"] == "ext4" and out["skipped"] == {"xfs": "loop-mounting an XFS "
                                                                     "needs root"}
    assert out["speedup_vs_full"] == out["ext4_rows_speedup_vs_full"] == 4.0
    assert out["speedup_vs_seed"] == 2.0 and out["named_speedup_vs_seed"] == 20.0
    assert out["watched_speedup_vs_full"] == 40.0 and out["written_bytes"] == 1050
    assert out["nochange_gbps"] == 2.0 and out["nochange_vs_hash"] == 0.1
    assert out["watch_write_cost"] == pytest.approx(3.0)
    assert all(out[k] is None for k in KEYS if k.startswith("xfs_"))


def test_summary_with_xfs(bench):
    out = bench.summary(10**9, 20.0, "ext4", rows(0.5, "2 whole"), rows(0.1, "2 reflink"),
                        (0.3, 0.1), {})
    assert out["xfs_rows_speedup_vs_full"] == 20.0 and out["xfs_speedup_vs_seed"] == 10.0
    assert out["xfs_named_speedup_vs_seed"] == 20.0 and out["xfs_written_bytes"] == 1050
    assert out["xfs_nochange_vs_hash"] == 0.5 and out["skipped"] == {}
    assert out["xfs_rows_ceiling_vs_full"] == 20.0  # full 2 s over (d)'s 0.1 s


def test_targets_met_missed_not_measured_and_not_applicable(bench):
    def line(lines: list[str], start: str) -> str:
        (found,) = [ln for ln in lines if ln.strip().startswith(start)]
        return found

    ext4 = rows(0.5, "2 whole")
    out = bench.summary(10**9, 20.0, "ext4", ext4, None, (0.3, 0.1), {})
    lines = bench.targets(out, {"ext4": ext4})
    assert "not measured" in line(lines, "(a) xfs, default path vs full")
    assert "10.0%  MISSED" in line(lines, "(d) ext4, default path vs xxh3")
    assert "20.00x  met" in line(lines, "(a) ext4, named vs seed")
    assert "4.00x  reported" in line(lines, "(a) ext4, default path vs full")
    assert "1.050  n/a" in line(lines, "(a) ext4, default path written / changed")

    xfs = rows(0.1, "1 whole, 2 reflink")
    out = bench.summary(10**9, 20.0, "ext4", ext4, xfs, (0.3, 0.1), {})
    lines = bench.targets(out, {"ext4": ext4, "xfs": xfs})
    assert line(lines, "(a) xfs, default path vs full").endswith("20.00x  met          >= 10x")
    assert "n/a" in line(lines, "(a) xfs, default path written")  # one shard whole
    lines = bench.targets(out, {"ext4": ext4, "xfs": rows(0.1, "2 reflink")})
    assert "1.050  met" in line(lines, "(a) xfs, default path written")
    lines = bench.targets(out, {"ext4": ext4, "xfs": rows(0.1, "2 journal") | {
        "a": rows(0.1, "2 journal")["a"] | {"written": dict(hotweights=1200)}}})
    assert "1.200  MISSED" in line(lines, "(a) xfs, default path written")


def test_table_has_a_column_group_per_filesystem(bench):
    lines = bench.table(10**9, {"ext4": rows(0.5, "2 whole"), "xfs": rows(0.1, "2 reflink")})
    assert "ext4" in lines[0] and "xfs" in lines[0]
    (named_a,) = [ln for ln in lines if ln.strip().startswith("named ")][:1]
    assert named_a.count("20.0x") == 2 and named_a.count("40.0x") == 2
    (seed_a,) = [ln for ln in lines if ln.strip().startswith("seed ")][:1]
    assert "x" not in seed_a.replace("seed", "")
    assert "2 whole" in "\n".join(lines) and "2 reflink" in "\n".join(lines)


def test_how_counts_the_shards_by_how_they_were_written(bench):
    assert bench._how({"a": "reflink", "b": "whole", "c": "reflink"}) == "2 reflink, 1 whole"
    assert bench._how({}) == "-"


def test_xfs_image_holds_six_copies_and_room_for_the_filesystem(bench):
    size = bench.xfs_image_bytes(10**9)
    assert size % (1 << 20) == 0 and size >= 6 * 10**9 + (512 << 20)


def test_xfs_image_is_written_whole_not_sparse(bench, tmp_path):
    image = tmp_path / "xfs.img"
    bench.write_zeros(image, 5 * 4096 + 100, chunk=8192)
    assert image.read_bytes() == bytes(5 * 4096 + 100)
    assert image.stat().st_blocks * 512 >= 5 * 4096 + 100  # allocated: no hole


def test_no_xfs_without_root_or_mkfs(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    with pytest.raises(bench.NoXfs, match="needs root"), bench.xfs_mount(tmp_path, 1 << 30):
        pass
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench.shutil, "which", lambda *a, **k: None)
    with pytest.raises(bench.NoXfs, match="mkfs.xfs not found"), \
            bench.xfs_mount(tmp_path, 1 << 30):
        pass
    assert list(tmp_path.iterdir()) == []
