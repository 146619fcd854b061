"""The user guide builds cleanly, and its reference covers every configuration key."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from click.testing import CliRunner
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from kvtier.cli import cli
from kvtier.cli.docs_reference import config_reference, option_rows, options_table
from kvtier.config import KVTierConfig
from kvtier.errors import MissingDependencyError, PluginLoadError
from kvtier.testing import restore_registries
from kvtier.tiers import register_tier, tier_registry

ROOT = Path(__file__).resolve().parents[2]


def section(markdown: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of any level."""
    start = markdown.index(heading + "\n") + len(heading)
    following = re.search(r"^#{1,6} ", markdown[start:], flags=re.MULTILINE)
    return markdown[start : start + following.start()] if following else markdown[start:]


def documented_keys(markdown: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", markdown, flags=re.MULTILINE))


def all_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= all_keys(annotation, f"{prefix}{name}.")
    return keys


def test_every_top_level_key_is_in_the_reference() -> None:
    reference = config_reference()
    expected = all_keys(KVTierConfig) - {"secondary_tiers"}
    assert {"backpressure.max_inflight_stores", "metrics.port"} <= expected
    assert expected <= documented_keys(section(reference, "## Top-level keys"))
    entry = documented_keys(section(reference, "## Secondary tiers"))
    assert entry == {"type", "module_path", "codec"}


def test_every_key_of_the_redis_cluster_index_is_in_the_reference() -> None:
    from kvtier.fleet.redis import RedisIndexOptions

    reference = config_reference()
    text = section(reference[reference.index("## Cluster index") :], "### `redis`")
    assert documented_keys(text) == set(RedisIndexOptions.model_fields)


@pytest.mark.parametrize("tier_type", tier_registry.registered_names())
def test_every_key_of_every_built_in_tier_is_in_the_reference(tier_type: str) -> None:
    try:
        cls = tier_registry.resolve(tier_type)
    except PluginLoadError as exc:
        if isinstance(exc.__cause__, (MissingDependencyError, ModuleNotFoundError)):
            pytest.skip(f"tier {tier_type!r} needs an optional dependency: {exc.__cause__}")
        raise
    text = section(config_reference(), f"### `{tier_type}`")
    keys = set(cls.Options.model_fields)
    if keys:
        assert keys == documented_keys(text)
        for name, field in cls.Options.model_fields.items():
            assert field.description, f"{tier_type}.{name} has no docstring"
    else:
        assert "No options." in text


def test_a_tier_whose_module_does_not_import_is_listed_with_the_reason() -> None:
    with restore_registries():
        register_tier("ghost", "no_such_module_for_kvtier_docs", "GhostTier")
        text = section(config_reference(), "### `ghost`")
    assert "no_such_module_for_kvtier_docs.GhostTier" in text
    assert "does not import here" in text and "No module named" in text


class _Sample(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    mode: Literal["auto", "on", "off"] = "auto"
    """How."""

    limit: ByteSize | None = Field(default=None, gt=0)
    """How much."""

    size: ByteSize = ByteSize(3 << 30)
    """Size | with a pipe."""

    root: Path
    """Where."""

    extra: dict[str, int] = Field(default_factory=dict)
    """More."""


def test_types_defaults_and_bounds_read_naturally() -> None:
    rows = {row.key: row for row in option_rows(_Sample)}
    assert rows["mode"].type == '"auto" | "on" | "off"' and rows["mode"].default == '`"auto"`'
    assert rows["limit"].type == "size or null, > 0" and rows["limit"].default == "unset"
    assert rows["size"].default == "`3GiB`"
    assert rows["root"].type == "path" and rows["root"].default == "required"
    assert rows["extra"].type == "mapping" and rows["extra"].default == "`{}`"
    table = options_table(list(rows.values()))
    assert "Size \\| with a pipe." in table
    # Every row has the four cells of the header, pipes inside cells escaped.
    assert all(len(re.split(r"(?<!\\)\|", line)) == 6 for line in table.splitlines())


def test_config_reference_command_prints_the_reference() -> None:
    result = CliRunner().invoke(cli, ["config-reference"])
    assert result.exit_code == 0
    assert result.output == config_reference(installed=True)


def test_config_reference_command_lists_installed_out_of_tree_plugins() -> None:
    """The test plugin package declares tiers, a policy and a spec as entry points."""
    printed = CliRunner().invoke(cli, ["config-reference"]).output
    tier = section(printed, "### `entry-tier`")
    assert "Class `kvtier_testplugin.tiers.EntryPointTier`" in tier
    assert "Installed from another package" in tier
    assert "`label`" in tier and "`weight`" in tier  # its own typed options
    refused = section(printed, "### `not-a-tier`")
    assert "does not import here" in refused and "PluginTypeError" in refused
    assert "| `entry-lru` | `kvtier_testplugin.policies.EntryPointPolicy` |" in printed
    assert "| `entry-spec` | `kvtier_testplugin.specs.EntryPointSpec` |" in printed
    # The user guide documents kvtier's own only: it must not depend on the build machine.
    assert "entry-tier" not in config_reference() and "entry-lru" not in config_reference()


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not Path(sys.executable).with_name("mkdocs").exists(),
    reason="mkdocs not installed: pip install -e '.[docs]'",
)
def test_the_user_guide_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr
    page = (site / "configuration" / "index.html").read_text()
    assert "max_inflight_stores" in page and '<h3 id="memory"' in page
    assert "kvtier:config-reference" not in page


def test_generating_the_reference_imports_no_backend_client() -> None:
    """Reading every tier's options must work where no backend client is installed."""
    clients = ["redis", "boto3", "botocore", "zmq", "torch", "transformers", "vllm"]
    script = (
        "import sys\n"
        "from kvtier.cli.docs_reference import config_reference\n"
        "config_reference()\n"
        f"print(sorted(m for m in {clients!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_install_commands_in_the_docs_work_from_a_checkout() -> None:
    """kvtier is not on the package index yet: a bare ``pip install kvtier`` fails."""
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    bare = re.compile(r"^\s*pip install (?:-U )?['\"]?kvtier(?:\[[^\]]*\])?['\"]?\s*(?:#.*)?$")
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not bare.match(line), f"{page.name}:{number}: {line.strip()}"


def test_the_test_script_keeps_its_own_environment() -> None:
    """The README's first command makes a plain ``.venv``; the tests must not rebuild it."""
    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts" / "test.sh").read_text()
    created = re.findall(r"python3 -m venv (\S+)", script)
    assert created and ".venv" not in created
    assert "python3 -m venv .venv " in (root / "README.md").read_text()


def test_a_missing_extra_names_the_command_for_a_checkout_and_for_a_release() -> None:
    message = str(MissingDependencyError("redis", "redis"))
    assert "pip install 'kvtier[redis]'" in message
    assert "pip install '.[redis]'" in message


def test_every_built_in_codec_and_its_options_are_in_the_reference() -> None:
    from kvtier.codecs import codec_registry

    reference = config_reference()
    for name in codec_registry.registered_names():
        assert f"### `{name}`" in reference
    assert {"group_size"} == documented_keys(section(reference, "### `int4`"))
    assert {"compressor", "level"} == documented_keys(section(reference, "### `lossless`"))
