"""The settings table (``pantheon/config/table.py``) is the single source of every setting: each
row yields its flag, its variables and its TOML key; parsing nothing gives the table's defaults;
flag > variable > config file > default; a bad value from each source is a ``ConfigError`` that
names that source; ``--help`` shows each flag's help and default from the table; and
``pantheon.config`` imports nothing from ``pantheon.workerlink`` (the old import cycle)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_contract import imports

from pantheon.config.cli import default_text, help_text
from pantheon.config.file import merge_config_file
from pantheon.config.ops import Limits, OpsConfig
from pantheon.config.settings import ConfigError, ServeConfig, build_config
from pantheon.config.table import BY_NAME, SETTINGS, Setting
from pantheon.core.kv_types import KvCacheTypes
from pantheon.serve import build_parser

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
CONFIG_ROWS = [s for s in SETTINGS if s.field is not None]
BAD = "not-a-value!"  # no row reads this as its sample value; most refuse it


def samples(tmp: Path) -> dict[str, tuple[str, object]]:
    """A valid, non-default text value for each config row, and what it parses to."""
    return {
        "host": ("0.0.0.0", "0.0.0.0"),
        "port": ("8123", 8123),
        "slots": ("4", 4),
        "queue_depth": ("3", 3),
        "queue_timeout": ("2.5", 2.5),
        "prefill_chunk": ("64", 64),
        "cpu_dies": ("2", 2),
        "cpu_die_budget": ("1GiB", 1 << 30),
        "kv_budget": ("2MiB", 2 << 20),
        "admit_ctx": ("1024", 1024),
        "kv_fraction": ("0.5", 0.5),
        "state_checkpoints": ("3", 3),
        "die_reserve": ("0", 0),
        "pressure_thresholds": ("0.5,0.6,0.7", (0.5, 0.6, 0.7)),
        "max_model_len": ("256", 256),
        "dtype": ("float32", "float32"),
        "max_body": ("1MiB", 1 << 20),
        "max_body_in_flight": ("16MiB", 16 << 20),
        "hello_timeout": ("5", 5.0),
        "worker_threads": ("2", 2),
        "log_level": ("DEBUG", "debug"),
        "test_hooks": ("1", True),
        "api_key": ("k1", ("k1",)),
        "admin_key": ("adm", "adm"),
        "cors_origins": ("https://a.example,http://b:8080", ("https://a.example", "http://b:8080")),
        "models_dir": (str(tmp), (os.path.realpath(tmp),)),
        "keep_alive": ("10m", 600.0),
        "load_timeout": ("60", 60.0),
        "models_max": ("2", 2),
        "speculative": ("4", 4),
        "max_messages": ("10", 10),
        "max_n": ("3", 3),
        "max_tokens_limit": ("100", 100),
        "max_stop": ("2", 2),
        "max_stop_len": ("9", 9),
        "log_format": ("json", "json"),
        "drain_timeout": ("3", 3.0),
        "registry_url": ("http://r:1/", "http://r:1"),
        "registry_heartbeat": ("2", 2.0),
        "node_id": ("n1", "n1"),
        "registry_transport": ("rdma", "rdma"),
        "advertise_host": ("h", "h"),
        "worker_restarts": ("0", 0),
        "restart_backoff": ("1", 1.0),
        "step_timeout": ("10", 10.0),
        "step_target": ("0.1", 0.1),
        "worker_listen": ("tcp://127.0.0.1:5999", "tcp://127.0.0.1:5999"),
        "curve_dir": ("/k", "/k"),
        "worker_insecure": ("1", True),
        "worker_dead_after": ("5", 5.0),
        "driver_sample": ("1", True),
        "prefill_batch": ("0", False),
        "step_stats": ("1", True),
        "tool_auto": ("decide", "decide"),
        "kv_cache_dtype": ("q8_0", "q8_0"),
        "kv_cache_dtype_k": ("q4_0", "q4_0"),
        "kv_cache_dtype_v": ("Q8_0", "q8_0"),
        "kv_q4": ("1", True),
        "cpu_path": ("fp32", "fp32"),
        "compile": ("1", True),
        "compile_cache_dir": ("/c", "/c"),
        "compile_cache_max_mb": ("64", 64),
        "async_poll_us": ("2000", 2000),
    }


# a value each typed or checked row refuses (str rows without a check accept anything)
BAD_VALUES = {"int": "x", "float": "x", "bool": "maybe", "size": "lots", "size0": "lots", "thresholds": "1,2"}
BAD_BY_NAME = {
    "dtype": "fp8",
    "log_format": "xml",
    "registry_url": "ftp://x",
    "cpu_path": "nope",
    "models_dir": "/no/such/folder/at/all",
    "keep_alive": "soon",
    "kv_cache_dtype": "q5_1",
    "kv_cache_dtype_k": "int4",
    "kv_cache_dtype_v": "fp16",
}
# the spec's aliases that mean something of their own
ENV_EXPECT = {"QWEN35_BATCH_SLOTS": 8}  # 1 (here: any n > 0) turns on batching: 8 slots


def field_of(cfg: ServeConfig, row: Setting):
    obj, name = cfg, row.field
    if name.startswith("ops."):
        obj, name = cfg.ops, name[4:]
    elif name.startswith("limits."):
        obj, name = cfg.ops.limits, name[7:]
    return getattr(obj, name)


def argv_for(row: Setting, raw: str) -> list[str]:
    return [row.flag] if row.kind in ("bool", "switch") else [row.flag, raw]


def parsed(argv: list[str]) -> dict:
    return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}


def with_file(tmp: Path, text: str, argv=(), env=None) -> ServeConfig:
    f = tmp / "settings.toml"
    f.write_text(text)
    env = env or {}
    return build_config(merge_config_file(parsed(["--config", str(f), *argv]), env), env)


def test_samples_cover_every_row(tmp_path):
    assert set(samples(tmp_path)) == {s.name for s in CONFIG_ROWS}
    for s in SETTINGS:
        assert s.help and s.kind, s.name
        assert s.flag or s.env, f"{s.name}: no way to set it"


def test_every_row_yields_its_flag_env_and_toml_key(tmp_path):
    ap = build_parser()
    options = {o for a in ap._actions for o in a.option_strings} - {"-h", "--help"}
    assert options == {s.flag for s in SETTINGS if s.flag}  # no flag outside the table
    for name, (raw, want) in samples(tmp_path).items():
        row = BY_NAME[name]
        if row.flag:
            assert field_of(build_config(parsed(argv_for(row, raw)), {}), row) == want, row.flag
        for var in row.env:
            got = field_of(build_config({}, {var: raw}), row)
            assert got == ENV_EXPECT.get(var, want), var
        if row.toml:
            got = field_of(with_file(tmp_path, f"{row.toml} = {json.dumps(raw)}\n"), row)
            assert got == want, row.toml
            kebab = row.toml.replace("_", "-")
            assert field_of(with_file(tmp_path, f"{kebab} = {json.dumps(raw)}\n"), row) == want


def test_toml_native_types(tmp_path):
    c = with_file(
        tmp_path,
        "port = 9001\nqueue_timeout = 2\nstep_stats = true\n"
        'api_key = ["a", "b"]\nmax_body = 4096\nmax_tokens = 7\n',
    )
    assert (c.port, c.queue_timeout_s, c.ops.step_stats) == (9001, 2.0, True)
    assert c.ops.api_keys == ("a", "b") and c.max_body_bytes == 4096
    assert c.ops.limits.max_tokens == 7  # an alias key of max_tokens_limit


def test_nothing_given_is_the_tables_defaults():
    cfg = build_config(parsed([]), {})
    plain = ServeConfig()
    for row in CONFIG_ROWS:
        assert field_of(cfg, row) == row.default, row.name
        assert field_of(plain, row) == row.default, row.name  # the structs' defaults are its
    assert OpsConfig() == cfg.ops and Limits() == cfg.ops.limits


def test_precedence_flag_over_env_over_file(tmp_path):
    checked = {"env over file": 0, "flag over env": 0, "flag over file": 0}  # each case ran
    for name, (raw, want) in samples(tmp_path).items():
        row = BY_NAME[name]
        env = {var: raw for var in row.env}
        if row.env:
            expect = ENV_EXPECT.get(row.env[0], want)
            if row.toml:  # a variable beats the file (the file's value is never read)
                c = with_file(tmp_path, f"{row.toml} = {json.dumps(BAD)}\n", env=env)
                assert field_of(c, row) == expect, name
                checked["env over file"] += 1
            if row.flag:  # a flag beats the variables (theirs are never read)
                bad_env = {var: BAD for var in row.env}
                c = build_config(parsed(argv_for(row, raw)), bad_env)
                assert field_of(c, row) == want, name
                checked["flag over env"] += 1
        if row.flag and row.toml:
            c = with_file(tmp_path, f"{row.toml} = {json.dumps(BAD)}\n", argv_for(row, raw))
            assert field_of(c, row) == want, name
            checked["flag over file"] += 1
    assert all(checked.values()), checked


def test_bad_value_names_its_source(tmp_path):
    f = tmp_path / "bad.toml"
    checked = 0
    for row in CONFIG_ROWS:
        bad = BAD_BY_NAME.get(row.name, BAD_VALUES.get(row.kind))
        if bad is None:
            continue
        checked += 1
        if row.flag:
            with pytest.raises(ConfigError, match=re.escape(row.flag)):
                build_config({row.name: bad}, {})
        for var in row.env:
            with pytest.raises(ConfigError, match=re.escape(var)):
                build_config({}, {var: bad})
        if row.toml:
            f.write_text(f"{row.toml} = {json.dumps(bad)}\n")
            with pytest.raises(ConfigError, match=re.escape(f"--config {f}: {row.toml}")):
                build_config(merge_config_file({"config": str(f)}, {}), {})
    assert checked >= 30
    # range checks too, not only parsing
    for args, env, what in (
        ({"port": 70000}, {}, "--port"),
        ({}, {"PANTHEON_PORT": "70000"}, "PANTHEON_PORT"),
        ({}, {"BS_QUEUE_DEPTH": "-1"}, "BS_QUEUE_DEPTH"),
        ({"max_n": 999}, {}, "--max-n"),
    ):
        with pytest.raises(ConfigError, match=re.escape(what)):
            build_config(args, env)
    f.write_text("max_n = 999\n")
    with pytest.raises(ConfigError, match=re.escape(f"--config {f}: max_n 999")):
        build_config(merge_config_file({"config": str(f)}, {}), {})


def test_help_lists_every_flag_with_its_help_and_default():
    text = build_parser().format_help()
    flat = re.sub(r"\s+", "", text)  # argparse wraps lines, also inside words with a hyphen
    for row in SETTINGS:
        if row.flag:
            assert row.flag in text, row.flag
            assert re.sub(r"\s+", "", help_text(row)) in flat, row.flag
        else:  # the variables-only knobs are in the epilog
            assert " / ".join(row.env) in text, row.name
            assert re.sub(r"\s+", "", row.help) in flat, row.name
        if row.field and row.default not in (None, ()):
            assert default_text(row) is not None, row.name
    assert "(default 8)" in help_text(BY_NAME["slots"])
    assert "default 8MiB" in help_text(BY_NAME["max_body"])
    assert "default 30 s" in help_text(BY_NAME["queue_timeout"])


def test_config_never_imports_workerlink():
    for path in sorted((ROOT / "pantheon" / "config").glob("*.py")):
        bad = [n for n, _ in imports(path) if n.startswith("pantheon.workerlink")]
        assert not bad, f"{path.name} imports {bad}"
    code = (
        "import sys; import pantheon.config.settings, pantheon.config.cli, "
        "pantheon.config.file, pantheon.config.ops; "
        "bad = [m for m in sys.modules if m.startswith('pantheon.workerlink')]; "
        "assert not bad, bad; import pantheon.core.curve"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )


def test_kv_cache_types_resolve_k_and_v(tmp_path):
    """--kv-cache-dtype sets K and V, -k/-v set one apart; the spec's QWEN35_KV_Q4=1 is q4_0 for
    both (0: auto) unless --kv-cache-dtype is given; a model's kv_cache_dtype takes "q8_0" or
    "K/V"; a bad one is refused naming where it came from."""
    assert str(build_config({}, {}).kv_types) == "auto"
    for env in ({"QWEN35_KV_Q4": "1"}, {"PANTHEON_KV_Q4": "1"}):
        assert build_config({}, env).kv_types == KvCacheTypes("q4_0", "q4_0")
    assert build_config({}, {"QWEN35_KV_Q4": "0"}).kv_types == KvCacheTypes()
    # a --kv-cache-dtype from any source beats the spec's switch; -k / -v beat both
    assert build_config({"kv_cache_dtype": "q8_0"}, {"QWEN35_KV_Q4": "1"}).kv_types.k == "q8_0"
    assert build_config({}, {"QWEN35_KV_Q4": "1", "PANTHEON_KV_CACHE_DTYPE": "auto"}).kv_types.v == "auto"
    c = build_config({"kv_cache_dtype_k": "q8_0"}, {"QWEN35_KV_Q4": "1"})
    assert c.kv_types == KvCacheTypes("q8_0", "q4_0") and str(c.kv_types) == "q8_0/q4_0"
    assert build_config({"kv_cache_dtype_v": "q4_0"}, {}).kv_types == KvCacheTypes("auto", "q4_0")
    # the fingerprint changes with a quantized cache (its outputs differ), not without one
    assert build_config({}, {}).fingerprint == build_config({}, {"QWEN35_KV_Q4": "0"}).fingerprint
    assert build_config({}, {}).fingerprint != build_config({}, {"QWEN35_KV_Q4": "1"}).fingerprint
    f = tmp_path / "m.toml"
    f.write_text('[[models]]\npath = "/m"\nkv_cache_dtype = "q8_0/q4_0"\n\n[[models]]\npath = "/n"\n')
    c = build_config(merge_config_file({"config": str(f)}, {}), {})
    assert [m.kv_cache_dtype for m in c.models] == [KvCacheTypes("q8_0", "q4_0"), None]
    for bad in ('"q3_k"', '"q8_0/q4_0/q4_0"', "8"):
        f.write_text(f'[[models]]\npath = "/m"\nkv_cache_dtype = {bad}\n')
        with pytest.raises(ConfigError, match=re.escape(f"--config {f}: [[models]] #1: kv_cache_dtype")):
            build_config(merge_config_file({"config": str(f)}, {}), {})
    with pytest.raises(ConfigError, match="PANTHEON_KV_CACHE_DTYPE_K 'q5': use auto, q8_0, q4_0 or fp8_e4m3"):
        build_config({}, {"PANTHEON_KV_CACHE_DTYPE_K": "q5"})


def test_ollama_kv_cache_type_is_an_alias():
    """Ollama's OLLAMA_KV_CACHE_TYPE sets K and V: its f16 is the full-width cache (auto), q8_0
    and q4_0 are ours; the flag > PANTHEON_KV_CACHE_DTYPE > it, and it beats the file and the
    spec's QWEN35_KV_Q4 as any kv_cache_dtype source does; a bad value is refused naming it."""
    for raw, want in (("f16", "auto"), ("F16", "auto"), ("q8_0", "q8_0"), ("Q4_0", "q4_0")):
        c = build_config({}, {"OLLAMA_KV_CACHE_TYPE": raw})
        assert str(c.kv_types) == want, raw
    assert build_config({}, {"OLLAMA_KV_CACHE_TYPE": "f16"}).kv_types == KvCacheTypes()
    ollama = {"OLLAMA_KV_CACHE_TYPE": "q4_0"}
    assert str(build_config({}, {**ollama, "PANTHEON_KV_CACHE_DTYPE": "q8_0"}).kv_types) == "q8_0"
    assert str(build_config({"kv_cache_dtype": "auto"}, ollama).kv_types) == "auto"
    assert str(build_config({}, {"OLLAMA_KV_CACHE_TYPE": "f16", "QWEN35_KV_Q4": "1"}).kv_types) == "auto"
    c = build_config({"kv_cache_dtype_k": "q8_0"}, ollama)  # -k beats it for K only
    assert c.kv_types == KvCacheTypes("q8_0", "q4_0")
    assert build_config({}, {"OLLAMA_KV_CACHE_TYPE": ""}).kv_types == KvCacheTypes()  # empty: unset
    assert build_config({}, {}).fingerprint != build_config({}, ollama).fingerprint
    # the spec's words only: auto and fp8_e4m3 are ours, not Ollama's (it has f16 for auto)
    for bad in ("q5_1", "auto", "fp8_e4m3", "bf16"):
        with pytest.raises(ConfigError, match=re.escape(f"OLLAMA_KV_CACHE_TYPE {bad!r}: use f16")):
            build_config({}, {"OLLAMA_KV_CACHE_TYPE": bad})
    # a lower source is not read once a higher one is set
    assert (
        str(build_config({}, {"PANTHEON_KV_CACHE_DTYPE": "q8_0", "OLLAMA_KV_CACHE_TYPE": "x"}).kv_types)
        == "q8_0"
    )
