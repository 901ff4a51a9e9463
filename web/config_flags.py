"""Command-line flags for every config.toml key, resolved by load_config like everywhere else: a flag wins
over its SLUICE_<KEY> environment variable, which wins over the config file. The help of each flag is the
comment above its key in the repository's config.toml, and names the value that applies without the flag."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path

from engine.config import DEFAULT_CONFIG_PATH, ClusterConfig, EngineConfig, ServerConfig, SluiceConfig, load_config

ConfigClass = type[EngineConfig] | type[ServerConfig] | type[ClusterConfig]
SECTIONS: dict[str, ConfigClass] = {"engine": EngineConfig, "server": ServerConfig, "cluster": ClusterConfig}
SECRET_KEYS = frozenset({"api_key"})  # never printed, not even in --help
METAVARS = {bool: "BOOL", int: "N", float: "X", str: "TEXT"}


def documented_keys(path: Path = DEFAULT_CONFIG_PATH) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment lines right above `key = ...` in a config.toml, joined."""
    docs: dict[tuple[str, str], str] = {}
    section, comment = "", []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
        elif stripped.startswith("["):
            section, comment = stripped.strip("[]"), []
        elif "=" in stripped:
            docs[(section, stripped.split("=", 1)[0].strip())] = " ".join(comment)
            comment = []
        else:
            comment = []
    return docs


def _default_of(f: Field) -> object:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def add_config_flags(
    parser: argparse.ArgumentParser,
    sections: tuple[str, ...] = ("engine", "server", "cluster"),
    argv: Sequence[str] | None = None,
) -> None:
    """--config plus one flag per key of the given sections (values stay strings: load_config coerces). The help
    shows the values in effect: those of the file that argv's --config names, if any."""
    parser.add_argument("--config", metavar="PATH", help=f"a config.toml (default: {DEFAULT_CONFIG_PATH})")
    docs = documented_keys()
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--config")
    try:
        in_effect: SluiceConfig | None = load_config(named.parse_known_args(argv)[0].config)
    except ValueError as error:  # a bad file or SLUICE_* variable: reported when the flags are resolved
        parser.epilog = f"The configuration in effect could not be read ({error}): the defaults shown are built in."
        in_effect = None
    for section in sections:
        group = parser.add_argument_group(f"[{section}] in config.toml")
        for f in fields(SECTIONS[section]):
            default = _default_of(f)
            help_text = docs.get((section, f.name), "").replace("%", "%%")
            current = getattr(getattr(in_effect, section), f.name) if in_effect is not None else default
            if f.name in SECRET_KEYS:
                shown = "set" if current else "none"
            else:
                shown = repr(current)
            env_name = f"SLUICE_{f.name.upper()}"
            source = f"; from {env_name}" if env_name in os.environ else ""
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                metavar=METAVARS.get(type(default), "VALUE"),
                help=f"{help_text} (default: {shown}{source})".strip(),
            )


def config_from_args(args: argparse.Namespace) -> SluiceConfig:
    """Raises ValueError for a bad value, wherever it came from."""
    values = vars(args)
    overrides = {
        section: {f.name: values.get(f.name) for f in fields(cls) if f.name in values}
        for section, cls in SECTIONS.items()
    }
    return load_config(
        values.get("config"),
        engine_overrides=overrides["engine"],
        server_overrides=overrides["server"],
        cluster_overrides=overrides["cluster"],
    )
