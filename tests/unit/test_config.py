"""Config: sizes, the embedded default, TOML files, env overrides, and the errors operators see."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pydantic
import pytest

from ckptdrain.daemon.config import (
    AccessConfig,
    Config,
    ConfigError,
    DestinationConfig,
    LimitsConfig,
    MetricsConfig,
)
from ckptdrain.daemon.configload import (
    default_socket_path,
    embedded_default,
    load_config,
    with_limits_from,
)
from ckptdrain.daemon.sizes import GiB, KiB, MiB, TiB, parse_size

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "ckptdrain.example.toml"
DOCS = REPO / "docs" / "configuration.md"

# A clean environment: tests never depend on the caller's CKPTDRAIN_* or XDG variables.
BASE_ENV = {"HOME": "/home/alice"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ckptdrain.toml"
    path.write_text(text)
    return path


def error_of(path: Path | None = None, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={**BASE_ENV, **(env or {})})
    err = info.value
    assert str(err) == f"{err.key}: {err.reason}"
    assert "pydantic" not in str(err).lower() and "Input should" not in str(err)
    return err


# ---------------------------------------------------------------------------------------------
# parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("0", 0),
        ("4096", 4096),
        ("12B", 12),
        ("4KiB", 4 * KiB),
        ("64MiB", 64 * MiB),
        ("800GiB", 800 * GiB),
        ("1TiB", TiB),
        ("1.5GB", 1_500_000_000),
        ("2KB", 2000),
        ("3MB", 3_000_000),
        ("1TB", 10**12),
        ("0.5KiB", 512),
        ("800 GiB", 800 * GiB),
        ("1_000", 1000),
        ("1e3", 1000),
    ],
)
def test_parse_size_accepts(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("80 GiBs", "is not a size"),
        ("", "is not a size"),
        ("GiB", "is not a size"),
        ("1.2.3GiB", "is not a size"),
        ("12 gigs", "is not a size"),
        ("-1", "negative"),
        ("-1GiB", "negative"),
        (-5, "negative"),
        ("0.5B", "whole number of bytes"),
        ("1.0000001KiB", "whole number of bytes"),
        (True, "is not a size"),
        ("1e999999999", "too large"),
        (2**63, "too large"),
        ("9EiB", "is not a size"),
    ],
)
def test_parse_size_rejects(text: int | str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_size(text)


# ---------------------------------------------------------------------------------------------
# Embedded default and field defaults


def test_embedded_default_needs_no_file_and_no_root() -> None:
    config = load_config(env={"HOME": "/home/alice"})
    uid = os.getuid()
    assert config.socket == Path(f"/tmp/ckptdrain-{uid}.sock")
    assert config.staging_dir == Path("/home/alice/.local/state/ckptdrain/staging")
    assert config.destination.uri == "file:///home/alice/.local/state/ckptdrain/destination"
    assert config.destination.root_path == Path("/home/alice/.local/state/ckptdrain/destination")
    assert config.metrics.listen == "127.0.0.1:9464"
    assert config.journal_path == config.staging_dir / "journal.sqlite3"


def test_embedded_default_follows_xdg() -> None:
    env = {"HOME": "/home/alice", "XDG_RUNTIME_DIR": "/run/user/1000", "XDG_STATE_HOME": "/st"}
    config = load_config(env=env)
    assert config.socket == Path(f"/run/user/1000/ckptdrain-{os.getuid()}.sock")
    assert config.staging_dir == Path("/st/ckptdrain/staging")
    assert config.destination.root_path == Path("/st/ckptdrain/destination")
    # An empty XDG variable counts as unset, as the XDG spec says.
    empty = load_config(env={"HOME": "/h", "XDG_RUNTIME_DIR": "", "XDG_STATE_HOME": ""})
    assert empty.socket == Path(f"/tmp/ckptdrain-{os.getuid()}.sock")
    assert empty.staging_dir == Path("/h/.local/state/ckptdrain/staging")


def test_default_socket_matches_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdrain.client import daemonsocket as client

    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/42"}) == Path(
        f"/run/user/42/ckptdrain-{os.getuid()}.sock"
    )
    # The client prefers the system socket when it exists; hide it so both take the fallback.
    monkeypatch.setattr(client, "SYSTEM_SOCKET_PATH", "/nonexistent/ckptdrain.sock")
    monkeypatch.delenv("CKPTDRAIN_SOCKET", raising=False)
    for runtime in ("/run/user/42", ""):
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
        assert Path(client.default_socket_path()) == default_socket_path()
        assert load_config(env={**BASE_ENV, "XDG_RUNTIME_DIR": runtime}).socket == Path(
            client.default_socket_path()
        )


def test_field_defaults_are_the_system_install() -> None:
    config = Config()
    assert config.node_id == socket.gethostname()
    assert config.socket == Path("/run/ckptdrain.sock")
    assert config.staging_dir == Path("/var/lib/ckptdrain/staging")
    assert config.ack == "local"
    assert config.log_level == "info"
    assert config.limits.max_staged_bytes == 800 * GiB
    assert config.limits.max_memory_bytes == 64 * GiB
    assert config.limits.max_queued_shards == 100_000
    assert config.limits.max_generations_in_flight == 2
    assert config.limits.on_full == "block"
    assert config.limits.block_timeout_s == 300.0
    assert config.limits.max_shard_bytes == TiB
    assert config.destination.scheme == "file"
    assert config.destination.part_size_bytes == 64 * MiB
    assert config.destination.checksum == "when_required"
    assert config.destination.stripe_count == -1
    assert config.destination.stripe_size_bytes == 4 * MiB
    assert config.drain.max_bandwidth_bytes_per_s == 0
    assert config.retention.keep_last == 3
    assert config.retention.keep_local_copy is True
    assert config.access.mode_int == 0o660
    assert config.access.allowed_uids == []


def test_unusable_hostname_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdrain.daemon import config as config_module

    monkeypatch.setattr(config_module, "gethostname", lambda: "bad host")
    err = error_of()
    assert err.key == "node_id"
    assert "set node_id explicitly" in err.reason


def test_a_node_id_is_no_longer_than_a_manifest_takes() -> None:
    # Found attacking the config: 129-253 characters passed `config check`, and `serve` then
    # died with a ManifestError traceback (exit 1) writing its first record.
    from ckptdrain.client.keys import MAX_NODE_BYTES, validate_node_id

    longest = "n" * MAX_NODE_BYTES
    config = load_config(env={**BASE_ENV, "CKPTDRAIN_NODE_ID": longest})
    assert validate_node_id(config.node_id) == longest
    err = error_of(env={"CKPTDRAIN_NODE_ID": longest + "n"})
    assert err.key == "node_id" and f"at most {MAX_NODE_BYTES}" in err.reason


def test_embedded_default_is_plain_data() -> None:
    data = embedded_default({"HOME": "/h"})
    assert set(data) == {"socket", "staging_dir", "destination", "metrics"}


# ---------------------------------------------------------------------------------------------
# Files


def test_example_file_documents_every_key_with_its_default() -> None:
    config = load_config(EXAMPLE, env=BASE_ENV)
    # node_id is commented out in the example (its default is the hostname).
    assert config == Config()
    text = EXAMPLE.read_text()
    for section, model in [("", Config)] + [
        (name, type(getattr(config, name)))
        for name in ("limits", "destination", "drain", "retention", "metrics", "access")
    ]:
        for key in model.model_fields:
            if section == "" and key in {"limits", "destination", "drain", "retention",
                                         "metrics", "access"}:
                assert f"[{key}]" in text
                continue
            assert re.search(rf"^#? ?{key} = ", text, re.M), f"{section}.{key} not in example"


def test_docs_name_every_key() -> None:
    text = DOCS.read_text()
    config = Config()
    for name in ("limits", "destination", "drain", "retention", "metrics", "access"):
        for key in type(getattr(config, name)).model_fields:
            assert f"`{key}`" in text, f"{name}.{key} missing from docs/configuration.md"
    for key in ("node_id", "socket", "staging_dir", "ack", "log_level"):
        assert f"`{key}`" in text
    assert "78" in text and "CKPTDRAIN_LIMITS__MAX_STAGED_BYTES" in text


def test_file_values_and_types(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
node_id = "gpu017"
socket = "/run/ck.sock"
staging_dir = "/nvme/ckpt"
ack = "memory"
log_level = "debug"

[limits]
max_staged_bytes = "1.5TB"
max_memory_bytes = 1073741824
on_full = "reject"
block_timeout_s = 30

[destination]
uri = "s3://ckpt-bucket/proj/llama/"
endpoint_url = "http://127.0.0.1:8333"
part_size_bytes = "128MiB"
max_concurrency = 16

[metrics]
listen = "[::1]:0"

[access]
socket_mode = "0640"
socket_group = "train"
allowed_uids = [1000, 1001]
""",
    )
    config = load_config(path, env=BASE_ENV)
    assert config.node_id == "gpu017"
    assert config.socket == Path("/run/ck.sock")
    assert config.staging_dir == Path("/nvme/ckpt")
    assert config.ack == "memory"
    assert config.limits.max_staged_bytes == 1_500_000_000_000
    assert config.limits.max_memory_bytes == GiB
    assert config.limits.block_timeout_s == 30.0
    assert isinstance(config.limits.block_timeout_s, float)
    assert config.destination.scheme == "s3"
    assert config.destination.bucket == "ckpt-bucket"
    assert config.destination.prefix == "proj/llama"
    assert config.destination.part_size_bytes == 128 * MiB
    assert config.metrics.host == "::1"
    assert config.metrics.port == 0
    assert config.metrics.enabled
    assert config.access.mode_int == 0o640
    assert config.access.allowed_uids == [1000, 1001]
    # Keys not in the file keep the system defaults, not the embedded (per-user) ones.
    assert config.retention.keep_last == 3


def test_config_is_frozen() -> None:
    config = Config()
    with pytest.raises(pydantic.ValidationError):
        config.ack = "memory"
    with pytest.raises(pydantic.ValidationError):
        config.limits.max_staged_bytes = 1


@pytest.mark.parametrize(
    ("toml", "key", "fragment"),
    [
        ('bogus = 1', "bogus", "unknown key"),
        ('[limits]\nmax_stagged_bytes = "1GiB"', "limits.max_stagged_bytes",
         "did you mean max_staged_bytes"),
        ('[nonsense]\nx = 1', "nonsense", "unknown key"),
        ('[limits]\nmax_staged_bytes = "80 GiBs"', "limits.max_staged_bytes",
         '"80 GiBs" is not a size; write e.g. "800GiB"'),
        ('[limits]\nmax_staged_bytes = "-3GiB"', "limits.max_staged_bytes", "negative"),
        ('[limits]\nmax_staged_bytes = 0', "limits.max_staged_bytes", "must be >= 1B"),
        ('[limits]\nmax_queued_shards = "many"', "limits.max_queued_shards",
         'expected an integer, got "many"'),
        ('[limits]\nmax_queued_shards = 1.5', "limits.max_queued_shards", "expected an integer"),
        ('[limits]\nblock_timeout_s = "5m"', "limits.block_timeout_s", "expected a number"),
        ('[limits]\non_full = "drop"', "limits.on_full",
         '"drop" is not one of "block", "reject" or "supersede"'),
        ('[limits]\nmax_generations_in_flight = 0', "limits.max_generations_in_flight",
         "must be >= 1 (got 0)"),
        ("limits = 3", "limits", "expected a table"),
        ('ack = "disk"', "ack", '"disk" is not one of'),
        ('ack = "memory"\n[limits]\nmax_memory_bytes = 0', "ack", "needs a RAM tier"),
        ('node_id = "gpu 17"', "node_id", "not a valid node id"),
        ('socket = "relative.sock"', "socket", "relative"),
        (f'socket = "/{"x" * 120}.sock"', "socket", "longer than 107 bytes"),
        ('staging_dir = "staging"', "staging_dir", "relative"),
        ('[destination]\nuri = "file://relative/path"', "destination.uri", "not an absolute"),
        ('[destination]\nuri = "ftp://host/x"', "destination.uri", "not a supported"),
        # Found attacking the URI checks: these passed `config check`, and `serve` (or a
        # destination command) then died with a traceback in the backend's own match.
        ('[destination]\nuri = "FILE:///p"', "destination.uri", "lower case"),
        ('[destination]\nuri = "file:/p"', "destination.uri", "not a supported"),
        ('[destination]\nuri = "S3://bucket"', "destination.uri", "not a supported"),
        ('[destination]\nuri = "s3://B/x"', "destination.uri", "valid bucket"),
        ('[destination]\nuri = "s3://bucket/a/../b"', "destination.uri", "unsafe prefix"),
        ('[destination]\nuri = "file:///a/../b"', "destination.uri", ".."),
        # Found as a new operator: `config check` said OK to a destination on the node's own
        # staging disk, its bytes counted as staged.
        ('staging_dir = "/srv/s"\n[destination]\nuri = "file:///srv/s/dest"', "destination.uri",
         "is inside staging_dir (/srv/s)"),
        ('staging_dir = "/srv/s/"\n[destination]\nuri = "file:///srv/s"', "destination.uri",
         "is inside staging_dir"),
        ('staging_dir = "/srv/d/staging"\n[destination]\nuri = "file:///srv/d"', "destination.uri",
         "is around staging_dir (/srv/d/staging)"),
        ('[destination]\nendpoint_url = "127.0.0.1:8333"', "destination.endpoint_url",
         "not an http(s) URL"),
        ('[destination]\nengine = "boto3"', "destination.engine",
         '"boto3" is not one of "aiobotocore" or "crt"'),
        ('[destination]\npart_size_bytes = "1MiB"', "destination.part_size_bytes",
         "must be >= 5MiB (got 1MiB)"),
        ('[destination]\nstripe_size_bytes = "100KiB"', "destination.stripe_size_bytes",
         "multiple of 64KiB"),
        ('[destination]\nstripe_count = -2', "destination.stripe_count", "must be >= -1"),
        ('[drain]\nretry_initial_backoff_s = 10\nretry_max_backoff_s = 1',
         "drain.retry_max_backoff_s", "below retry_initial_backoff_s"),
        # Found attacking a shared node: over max_clients, the per-uid share let one uid
        # take every connection, which the share is there to prevent.
        ('[limits]\nmax_clients = 256\nmax_clients_per_uid = 512',
         "limits.max_clients_per_uid", "more than max_clients (256)"),
        ('[retention]\nkeep_last = 0', "retention.keep_last", "must be >= 1"),
        ('[retention]\nkeep_local_copy = "yes"', "retention.keep_local_copy",
         "expected true or false"),
        ('[metrics]\nlisten = "9464"', "metrics.listen", "not host:port"),
        ('[metrics]\nlisten = "127.0.0.1:70000"', "metrics.listen", "above 65535"),
        ("[access]\nsocket_mode = 660", "access.socket_mode", "octal string"),
        ('[access]\nsocket_mode = "0999"', "access.socket_mode", "not a permission mode"),
        ('[access]\nsocket_group = "bad group"', "access.socket_group", "not a group"),
        ("[access]\nallowed_uids = [1, -1]", "access.allowed_uids", "not a valid uid"),
        ('[access]\nallowed_gids = ["wheel"]', "access.allowed_gids[0]", "expected an integer"),
        # Found attacking the operator's surface: values `config check` passed and `serve`
        # died of.
        # Path.expanduser raised RuntimeError: a traceback, exit 1, and a reload that broke.
        ('staging_dir = "~nosuchuser-ckptdrain/staging"\n', "staging_dir",
         "names no home directory here"),
        # The first system call raised ValueError ("embedded null byte"): a traceback.
        ('staging_dir = "/var/lib/ck\\u0000pt"\n', "staging_dir", "holds a NUL character"),
        ('socket = "/run/ck\\u0000.sock"\n', "socket", "holds a NUL character"),
        # chown raised OverflowError at start-up; 4294967295 is chown's "leave it as it is".
        ('[access]\nsocket_group = "4294967296"\n', "access.socket_group", "not a valid gid"),
        ('[access]\nsocket_group = "4294967295"\n', "access.socket_group", "not a valid gid"),
        # Every generation failed after retry_budget_s, or `ls` raised ValueError.
        ('[destination]\nuri = "s3://bkt/p"\nendpoint_url = "http://127.0.0.1:99999"\n',
         "destination.endpoint_url", "no valid port"),
        ('[destination]\nuri = "s3://bkt/p"\nendpoint_url = "http://127.0.0.1:0"\n',
         "destination.endpoint_url", "no valid port"),
        ('[destination]\nuri = "s3://bkt/p"\nendpoint_url = "http://exa mple:80"\n',
         "destination.endpoint_url", "is not an http(s) URL"),
        # An infinite interval never polled; 1e-300 s spun the event loop.
        ("[drain]\ncommit_poll_interval_s = inf\n", "drain.commit_poll_interval_s",
         "must be a finite number"),
        ("[drain]\ncommit_poll_interval_s = 1e-300\n", "drain.commit_poll_interval_s",
         "must be >= 0.01"),
        ("[drain]\nretry_budget_s = inf\n", "drain.retry_budget_s", "must be a finite number"),
    ],
)
def test_bad_file_names_key_and_reason(tmp_path: Path, toml: str, key: str, fragment: str) -> None:
    path = write(tmp_path, toml)
    err = error_of(path)
    assert err.key == key
    assert fragment in err.reason
    assert str(path) in err.reason  # says which file


def test_several_problems_report_the_first_and_count(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "[limits]\nmax_queued_shards = 0\nmax_clients = 0\n"))
    assert err.key == "limits.max_queued_shards"
    assert "1 more problem" in err.reason


def test_missing_file(tmp_path: Path) -> None:
    err = error_of(tmp_path / "absent.toml")
    assert err.key == str(tmp_path / "absent.toml")
    assert "no such config file" in err.reason


def test_directory_instead_of_file(tmp_path: Path) -> None:
    err = error_of(tmp_path)
    assert "is a directory" in err.reason


def test_unreadable_file(tmp_path: Path) -> None:
    # A path through a regular file fails for every user, root included (ENOTDIR).
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = error_of(blocker / "ckptdrain.toml")
    assert "cannot read the config file" in err.reason


def test_toml_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'ack = "local"\n[limits\nmax_clients = 3\n')
    err = error_of(path)
    assert err.key == str(path)
    assert "TOML syntax error" in err.reason
    assert "line 2" in err.reason


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.toml"
    path.write_bytes(b"ack = \xff\xfe\n")
    assert "not UTF-8" in error_of(path).reason


# ---------------------------------------------------------------------------------------------
# Environment


def test_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'node_id = "from-file"\n')
    config = load_config(env={**BASE_ENV, "CKPTDRAIN_CONFIG": str(path)})
    assert config.node_id == "from-file"
    # An explicit path wins over $CKPTDRAIN_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text('node_id = "explicit"\n')
    assert load_config(other, env={**BASE_ENV, "CKPTDRAIN_CONFIG": str(path)}).node_id == (
        "explicit"
    )


def test_env_overrides_file_with_typed_values(tmp_path: Path) -> None:
    path = write(tmp_path, '[limits]\nmax_staged_bytes = "1TiB"\non_full = "block"\n')
    env = {
        **BASE_ENV,
        "CKPTDRAIN_SOCKET": "/run/other.sock",
        "CKPTDRAIN_STAGING_DIR": "/nvme/x",
        "CKPTDRAIN_NODE_ID": "node-7",
        "CKPTDRAIN_ACK": "memory",
        "CKPTDRAIN_LIMITS__MAX_STAGED_BYTES": "64MiB",
        "CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS": "17",
        "CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S": "2.5",
        "CKPTDRAIN_DESTINATION__URI": "s3://bucket",
        "CKPTDRAIN_DESTINATION__ENDPOINT_URL": "http://127.0.0.1:8333",
        "CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY": "false",
        "CKPTDRAIN_ACCESS__ALLOWED_UIDS": "1000, 1001",
        "CKPTDRAIN_ACCESS__ALLOWED_GIDS": "[5, 6]",
        "CKPTDRAIN_METRICS__LISTEN": "",
        # Not keys: ignored.
        "CKPTDRAIN_CONFIG": str(path),
        "CKPTDRAIN_HOME": "/somewhere",
        "CKPTDRAIN_TEST_S3_PORT": "1234",
    }
    config = load_config(env=env)
    assert config.socket == Path("/run/other.sock")
    assert config.staging_dir == Path("/nvme/x")
    assert config.node_id == "node-7"
    assert config.ack == "memory"
    assert config.limits.max_staged_bytes == 64 * MiB
    assert config.limits.max_queued_shards == 17
    assert config.limits.block_timeout_s == 2.5
    assert config.limits.on_full == "block"  # from the file, untouched
    assert config.destination.bucket == "bucket"
    assert config.destination.prefix == ""
    assert config.destination.endpoint_url == "http://127.0.0.1:8333"
    assert config.retention.keep_local_copy is False
    assert config.access.allowed_uids == [1000, 1001]
    assert config.access.allowed_gids == [5, 6]
    assert not config.metrics.enabled
    assert config.metrics.address is None


def test_env_overrides_embedded_default() -> None:
    config = load_config(env={**BASE_ENV, "CKPTDRAIN_DESTINATION__URI": "file:///lustre/p"})
    assert config.destination.root_path == Path("/lustre/p")
    assert config.staging_dir == Path("/home/alice/.local/state/ckptdrain/staging")


def test_env_empty_optional_is_none() -> None:
    config = load_config(env={**BASE_ENV, "CKPTDRAIN_DESTINATION__ENDPOINT_URL": ""})
    assert config.destination.endpoint_url is None


@pytest.mark.parametrize(
    ("var", "fragment"),
    [
        ("CKPTDRAIN_LIMITS__MAX_STAGD_BYTES", "did you mean CKPTDRAIN_LIMITS__MAX_STAGED_BYTES"),
        ("CKPTDRAIN_NOSECTION__X", "is not a ckptdrain setting"),
        ("CKPTDRAIN_LIMITS", "names a section"),
    ],
)
def test_env_unknown_variable(var: str, fragment: str) -> None:
    err = error_of(env={var: "1"})
    assert err.key == var
    assert fragment in err.reason


@pytest.mark.parametrize("var", ["CKPTDRAIN_ATTEMPT", "CKPTDRAIN_RANK", "CKPTDRAIN_BOGUS"])
def test_env_names_that_are_not_config_shaped_are_left_alone(var: str) -> None:
    # The client's own variables share the prefix; only CKPTDRAIN_<KEY> for a top-level key
    # and CKPTDRAIN_<SECTION>__<KEY> are config.
    assert load_config(env={**BASE_ENV, var: "x"}) == load_config(env=BASE_ENV)


@pytest.mark.parametrize(
    ("var", "value", "key", "fragment"),
    [
        ("CKPTDRAIN_LIMITS__MAX_STAGED_BYTES", "80 GiBs", "limits.max_staged_bytes",
         "is not a size"),
        ("CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS", "lots", "limits.max_queued_shards",
         "expected an integer"),
        ("CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S", "soon", "limits.block_timeout_s",
         "expected a number"),
        ("CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY", "maybe", "retention.keep_local_copy",
         "expected true or false"),
        ("CKPTDRAIN_ACCESS__ALLOWED_UIDS", "1,x", "access.allowed_uids[1]", "expected an integer"),
        ("CKPTDRAIN_ACCESS__ALLOWED_UIDS", "[1,", "access.allowed_uids", "expected a list"),
        ("CKPTDRAIN_DESTINATION__URI", "lustre:/x", "destination.uri", "not a supported"),
    ],
)
def test_env_bad_value_names_key_and_variable(var: str, value: str, key: str, fragment: str) -> None:
    err = error_of(env={var: value})
    assert err.key == key
    assert fragment in err.reason
    assert f"set by {var}" in err.reason


# ---------------------------------------------------------------------------------------------
# Models used directly, reload, redaction


def test_models_accept_python_values() -> None:
    config = Config(
        socket="/tmp/x.sock",
        staging_dir=Path("/tmp/staging"),
        limits=LimitsConfig(max_staged_bytes="64MiB", block_timeout_s=1),
        destination=DestinationConfig(uri="memory://unit"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
    )
    assert config.socket == Path("/tmp/x.sock")
    assert config.limits.max_staged_bytes == 64 * MiB
    assert config.destination.scheme == "memory"
    assert config.metrics.port == 0


def test_destination_properties() -> None:
    posix = DestinationConfig(uri="file:///lustre/proj/ckpt/")
    assert posix.scheme == "file"
    assert posix.root_path == Path("/lustre/proj/ckpt")
    with pytest.raises(ValueError, match="not an s3"):
        _ = posix.bucket
    s3 = DestinationConfig(uri="s3://my.bucket-1/a/b")
    assert (s3.scheme, s3.bucket, s3.prefix) == ("s3", "my.bucket-1", "a/b")
    with pytest.raises(ValueError, match="not a file"):
        _ = s3.root_path
    assert DestinationConfig(uri="file://localhost/srv/x").root_path == Path("/srv/x")
    assert DestinationConfig(uri="file:///srv/with%20space").root_path == Path("/srv/with space")


def test_access_mode_spellings() -> None:
    assert AccessConfig(socket_mode="660").mode_int == 0o660
    assert AccessConfig(socket_mode="0o600").mode_int == 0o600
    assert AccessConfig(socket_mode="0600").mode_int == 0o600
    with pytest.raises(pydantic.ValidationError):
        AccessConfig(socket_mode="4755")


def test_with_limits_from_takes_limits_and_log_level_only(tmp_path: Path) -> None:
    old = load_config(
        write(tmp_path, 'node_id = "a"\nack = "local"\n[limits]\nmax_clients = 5\n'), env=BASE_ENV
    )
    (tmp_path / "new.toml").write_text(
        'node_id = "b"\nlog_level = "debug"\n[limits]\nmax_clients = 9\n'
        '[destination]\nuri = "s3://other"\n'
    )
    new = load_config(tmp_path / "new.toml", env=BASE_ENV)
    merged = with_limits_from(old, new)
    assert merged.limits == new.limits
    assert merged.log_level == "debug"
    assert merged.node_id == "a"
    assert merged.destination == old.destination
    assert old.limits.max_clients == 5  # the original is unchanged


def test_a_reload_keeps_the_data_planes_limits_and_says_they_need_a_restart() -> None:
    # Found attacking reload: io_threads and io_timeout_s size the data plane once, at
    # start-up; a SIGHUP logged "reloaded" with no needs_restart and changed nothing.
    from ckptdrain.daemon.startup import changed_keys, needs_restart

    old = Config()
    new = Config(limits=LimitsConfig(io_threads=16, io_timeout_s=5.0, max_clients=9))
    merged = with_limits_from(old, new)
    assert (merged.limits.io_threads, merged.limits.io_timeout_s) == (
        old.limits.io_threads, old.limits.io_timeout_s)
    assert merged.limits.max_clients == 9
    assert needs_restart(changed_keys(old, new)) == ["limits.io_threads", "limits.io_timeout_s"]


def test_an_io_timeout_below_a_tenth_of_a_second_is_a_config_error() -> None:
    # 1e-9 passed `config check`, and `serve` then failed its own start-up's first blocking
    # call as stuck I/O (exit 1, not 78).
    err = error_of(env={"CKPTDRAIN_LIMITS__IO_TIMEOUT_S": "1e-9"})
    assert err.key == "limits.io_timeout_s"


def test_with_limits_from_revalidates_cross_checks() -> None:
    old = Config(ack="memory")
    new = Config(limits=LimitsConfig(max_memory_bytes=0))
    with pytest.raises(ConfigError) as info:
        with_limits_from(old, new)
    assert info.value.key == "ack"


def test_redacted_dict_is_json_ready_and_masks_credentials() -> None:
    config = Config(
        destination=DestinationConfig(
            uri="s3://bucket/p", endpoint_url="http://admin:hunter2@127.0.0.1:8333"
        )
    )
    data = config.redacted_dict()
    assert data["socket"] == "/run/ckptdrain.sock"
    assert data["limits"]["max_staged_bytes"] == 800 * GiB
    assert data["destination"]["endpoint_url"] == "http://***@127.0.0.1:8333"
    assert "hunter2" not in repr(data)


def test_the_embedded_default_without_a_home_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A container's arbitrary uid: no $HOME, no passwd entry. Path.home() raised RuntimeError.
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(ConfigError) as info:
        load_config(None, env={})
    assert info.value.key == "staging_dir"
    assert "XDG_STATE_HOME" in info.value.reason and "config file" in info.value.reason


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    # Found attacking the reload: tomllib recursed past the interpreter's limit (a traceback
    # from `config check` and `serve`).
    err = error_of(write(tmp_path, "a = " + "[" * 5000 + "]" * 5000 + "\n"))
    assert "nests arrays or tables too deeply" in err.reason


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_config_that_is_no_regular_file_is_refused_without_reading_it(tmp_path: Path,
                                                                         kind: str) -> None:
    # Found attacking the reload: a FIFO's open waited for a writer for ever, and a config
    # linked to /dev/zero grew the process by gigabytes a second.
    path = tmp_path / "ckptdrain.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    err = error_of(path)
    assert err.key == str(path)
    assert ("not a regular file" if kind != "huge" else "larger than 1 MiB") in err.reason


def test_the_per_uid_client_share_is_half_of_max_clients_unless_set() -> None:
    # Found attacking a shared node: a fixed 512 per uid was no share at all on a node whose
    # max_clients an operator lowered to 256 (one uid could take every connection).
    assert LimitsConfig().clients_per_uid == 512
    assert LimitsConfig(max_clients=256).clients_per_uid == 128
    assert LimitsConfig(max_clients=1).clients_per_uid == 1
    assert LimitsConfig(max_clients=256, max_clients_per_uid=200).clients_per_uid == 200
