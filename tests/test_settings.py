"""Every HSSTORE_* variable is read in one place (`hsstore.settings`), when a value is used: a
variable set after import takes effect, and a malformed one is one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hsstore import settings
from hsstore.commits.lease import LeaseKeeper
from hsstore.settings import Settings, SettingsError
from hsstore.storage.local_store import LocalStorage


def test_unset_variables_mean_the_defaults():
    assert settings.current({}) == Settings()


def test_each_variable_is_parsed_into_its_field():
    got = settings.current(
        {
            "HSSTORE_RESOLVE_TIMEOUT": "2.5",
            "HSSTORE_LEASE_TTL": "7",
            "HSSTORE_STORAGE_RETRIES": "0",
            "HSSTORE_RETRY_TIMEOUT": "3",
            "HSSTORE_CACHE_DIR": "/cache",
            "HSSTORE_CACHE_BYTES": "1024",
            "HSSTORE_MALLOC_TUNING": "0",
            "HSSTORE_NO_FAST_DECODE": "1",
            "HSSTORE_SGLANG_UNTESTED": "1",
            "HSSTORE_SGLANG_CAPTURE": "lists",
        }
    )
    assert got == Settings(
        resolve_timeout_s=2.5, lease_ttl_s=7.0, storage_retries=0, retry_timeout_s=3.0,
        cache_dir="/cache", cache_bytes=1024, malloc_tuning=False, no_fast_decode=True,
        sglang_untested=True, sglang_capture="lists",
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, value",
    [("HSSTORE_LEASE_TTL", "soon"), ("HSSTORE_LEASE_TTL", "-1"), ("HSSTORE_CACHE_BYTES", "0"),
     ("HSSTORE_STORAGE_RETRIES", "2.5"), ("HSSTORE_MALLOC_TUNING", "yes")],
)  # fmt: skip
def test_a_malformed_value_names_the_variable(name, value):
    with pytest.raises(SettingsError) as caught:
        settings.current({name: value})
    message = str(caught.value)
    assert name in message and repr(value) in message and "\n" not in message


def test_a_variable_set_after_import_takes_effect(tmp_path, monkeypatch):
    monkeypatch.setenv("HSSTORE_LEASE_TTL", "12")
    assert LeaseKeeper(LocalStorage(str(tmp_path))).ttl_s == 12.0
    monkeypatch.delenv("HSSTORE_LEASE_TTL")
    assert LeaseKeeper(LocalStorage(str(tmp_path))).ttl_s == 60.0


def test_the_cli_says_which_variable_is_wrong(tmp_path):
    env = {**os.environ, "HSSTORE_LEASE_TTL": "soon"}
    done = subprocess.run(
        [sys.executable, "-c", "from hsstore.cli import main; main()", "gc", str(tmp_path)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode != 0
    assert "HSSTORE_LEASE_TTL='soon'" in done.stderr and "Traceback" not in done.stderr
