import argparse
from pathlib import Path

import pytest

from dynamo_tiered_kv.config import TieredKVConfig, settings_cli
from dynamo_tiered_kv.config.sizes import parse_size
from dynamo_tiered_kv.errors import ConfigError

pytestmark = pytest.mark.usefixtures("no_dtkv_env")


def test_defaults_and_mapping() -> None:
    c = TieredKVConfig.from_mapping({"ssd_dir": "/tmp/kv", "object_url": "file:///tmp/obj"})
    assert c.ssd_dir == Path("/tmp/kv") and c.object_url == "file:///tmp/obj"
    assert c.host_capacity_bytes > 0


def test_unknown_key_rejected_with_its_name() -> None:
    with pytest.raises(ConfigError, match="ssd_dirr: unknown setting"):
        TieredKVConfig.from_mapping({"ssd_dirr": "/tmp"})


def test_bad_value_names_field() -> None:
    with pytest.raises(ConfigError, match="object_url"):
        TieredKVConfig.from_mapping({"object_url": "http://x"})
    with pytest.raises(ConfigError, match="staging_slabs"):
        TieredKVConfig.from_mapping({"staging_slabs": 0})


def test_secrets_hidden() -> None:
    c = TieredKVConfig.from_mapping({"tenant_salt": "topsecret", "s3_secret_key": "hunter2"})
    assert "topsecret" not in repr(c) and "hunter2" not in repr(c)
    assert "hunter2" not in str(c.redacted())
    assert c.tenant_salt.get_secret_value() == "topsecret"


def test_env_and_yaml_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("ssd_capacity_bytes: 1000\nadmission: second_hit\n")
    monkeypatch.setenv("DYN_TIERED_KV_CONFIG_FILE", str(f))
    monkeypatch.setenv("DYN_TIERED_KV_SSD_CAPACITY_BYTES", "2000")
    c = TieredKVConfig.from_mapping({})
    assert c.ssd_capacity_bytes == 2000  # env beats YAML
    assert c.admission == "second_hit"  # YAML beats default
    assert TieredKVConfig.from_mapping({"ssd_capacity_bytes": 3000}).ssd_capacity_bytes == 3000  # dict wins
    assert TieredKVConfig.from_yaml(f).ssd_capacity_bytes == 2000


def test_unknown_env_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_SSD_DIRR", "/x")
    with pytest.raises(ConfigError, match="DYN_TIERED_KV_SSD_DIRR"):
        TieredKVConfig.from_mapping({})


def test_bad_yaml(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        TieredKVConfig.from_yaml(f)
    f.write_text("unknown_field: 1\n")
    with pytest.raises(ConfigError, match="unknown_field"):
        TieredKVConfig.from_yaml(f)


# --- one rule for unknown names, from every source: refused, named, with the closest match ------
def test_typo_in_kwargs_is_a_config_error_with_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"ssd_dirr: unknown setting in keyword arguments \(did you mean ssd_dir\?\)"):
        TieredKVConfig(ssd_dirr="/tmp")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"ssd_dirr: unknown setting in kv_connector_extra_config \(did you mean"):
        TieredKVConfig.from_mapping({"ssd_dirr": "/tmp"})


def test_bad_value_in_kwargs_is_one_line_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        TieredKVConfig(staging_slabs=0)
    assert "staging_slabs" in str(e.value) and "\n" not in str(e.value)


def test_typo_in_env_refused_by_plain_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_SSD_DIRR", "/x")
    with pytest.raises(ConfigError, match=r"DYN_TIERED_KV_SSD_DIRR: .*did you mean DYN_TIERED_KV_SSD_DIR\?"):
        TieredKVConfig()


def test_typo_in_yaml_names_file_and_suggests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("host_capacity_byte: 0\n")
    with pytest.raises(ConfigError, match=rf"host_capacity_byte: unknown setting in {f} .*host_capacity_bytes\?"):
        TieredKVConfig.from_yaml(f)
    monkeypatch.setenv("DYN_TIERED_KV_CONFIG_FILE", str(f))
    with pytest.raises(ConfigError, match="did you mean host_capacity_bytes"):
        TieredKVConfig()


def test_unknown_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as e:
        TieredKVConfig.from_mapping({"zzzz": 1})
    assert "zzzz: unknown setting" in str(e.value) and "did you mean" not in str(e.value)


def test_every_field_kept() -> None:
    c = TieredKVConfig.from_mapping({"load_async": False, "host_capacity_bytes": 0})
    assert c.load_async is False and c.host_capacity_bytes == 0


# --- one size syntax for every *_bytes setting, from every source ---------------------------------
BYTE_FIELDS = sorted(f for f in TieredKVConfig.model_fields if f.endswith("_bytes"))


@pytest.mark.parametrize(("text", "size"), [
    ("4096", 4096), ("16Gi", 16 << 30), ("16GiB", 16 << 30), ("16gib", 16 << 30), ("512Mi", 512 << 20),
    ("64 MiB", 64 << 20), ("2Ti", 2 << 40), ("8Ki", 8192), ("8KiB", 8192), ("100GB", 100 * 10**9),
    ("3MB", 3 * 10**6), ("1TB", 10**12), ("500G", 500 * 10**9), ("1.5Gi", 3 << 29), ("1_000", 1000),
])
def test_size_syntax(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["16 gigs", "Gi", "", "1.5", "1.1Ki", "16Gx", "0x10"])
def test_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_size(text)


def test_every_byte_setting_takes_a_size_from_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(BYTE_FIELDS) >= 6
    c = TieredKVConfig.from_mapping(dict.fromkeys(BYTE_FIELDS, "64Mi"))
    assert {f: getattr(c, f) for f in BYTE_FIELDS} == dict.fromkeys(BYTE_FIELDS, 64 << 20)
    f = tmp_path / "c.yaml"
    f.write_text("ssd_capacity_bytes: 16Gi\nhost_capacity_bytes: 1GB\n")
    monkeypatch.setenv("DYN_TIERED_KV_STAGING_SLAB_BYTES", "16MiB")
    c = TieredKVConfig.from_yaml(f)
    assert (c.ssd_capacity_bytes, c.host_capacity_bytes, c.staging_slab_bytes) == (16 << 30, 10**9, 16 << 20)
    args = argparse.Namespace(settings=["s3_part_bytes=16Mi"], config=None)
    assert settings_cli.load(args).config.s3_part_bytes == 16 << 20


def test_settings_errors_name_their_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def error(**kw: object) -> str:
        with pytest.raises(ConfigError) as e:
            TieredKVConfig.from_mapping(kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "ssd_capacity_bytes (from kv_connector_extra_config): not a size: '16 gigs'" in error(
        ssd_capacity_bytes="16 gigs")
    monkeypatch.setenv("DYN_TIERED_KV_STAGING_SLABS", "0")
    assert "staging_slabs (from DYN_TIERED_KV_STAGING_SLABS): Input should be greater" in error()
    monkeypatch.delenv("DYN_TIERED_KV_STAGING_SLABS")
    f = tmp_path / "c.yaml"
    f.write_text("host_capacity_bytes: lots\n")
    monkeypatch.setenv("DYN_TIERED_KV_CONFIG_FILE", str(f))
    assert f"host_capacity_bytes (from config file {f}): not a size" in error()
    monkeypatch.delenv("DYN_TIERED_KV_CONFIG_FILE")
    with pytest.raises(ConfigError, match=r"s3_part_bytes \(from --set s3_part_bytes\): not a size"):
        settings_cli.load(argparse.Namespace(settings=["s3_part_bytes=big"], config=None))
    with pytest.raises(ConfigError, match=r"s3_region \(from --s3-region\): Input should be a valid string"):
        settings_cli.load(argparse.Namespace(settings=[], config=None, s3_region=5))
