"""Server settings: command-line flags override ``MLXFLEET_*`` environment variables,
which override an optional YAML settings file (``--config`` or ``MLXFLEET_CONFIG``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mlxfleet"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLXFLEET_", extra="forbid")

    host: str = Field("127.0.0.1", description="address the gateway binds")
    port: int = Field(8000, ge=0, le=65535)
    manifests_dir: Path = Field(Path("manifests"), description="folder of Model manifests")
    state_dir: Path = Field(default_factory=default_state_dir,
                            description="logs and other state")
    log_level: str = "INFO"
    startup_timeout: float = Field(600.0, gt=0, description="seconds a worker may take to load")
    drain_timeout: float = Field(30.0, ge=0,
                                 description="seconds in-flight requests get on stop/replace")
    stop_timeout: float = Field(10.0, gt=0, description="seconds after SIGTERM before SIGKILL")
    backoff_base: float = Field(1.0, gt=0, description="first crash-restart delay, seconds")
    backoff_cap: float = Field(60.0, gt=0, description="longest crash-restart delay")
    stable_period: float = Field(60.0, gt=0,
                                 description="seconds Ready that reset the crash backoff")
    reload_debounce_ms: int = Field(300, ge=0)
    request_wait_timeout: float = Field(
        300.0, gt=0, description="seconds a request waits for its model to become ready")
    log_max_bytes: int = Field(10 << 20, gt=0)
    log_backups: int = Field(3, ge=0)

    config_file: Optional[Path] = Field(None, exclude=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get("MLXFLEET_CONFIG")
        init = init_settings.init_kwargs if hasattr(init_settings, "init_kwargs") else {}
        path = init.get("config_file") or path
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"settings file {path} does not exist")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(**flags: Any) -> ServerSettings:
    """Settings from flags (None values are treated as not given), env and file."""
    return ServerSettings(**{k: v for k, v in flags.items() if v is not None})
