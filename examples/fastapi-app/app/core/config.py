"""The app's settings, from the environment (or .env), as the template's backend reads them."""

from typing import Annotated, Any

from pydantic import BeforeValidator, computed_field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def parse_cors(v: Any) -> Any:
    if isinstance(v, str) and not v.startswith("["):
        return [i.strip() for i in v.split(",") if i.strip()]
    return v


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_ignore_empty=True, extra="ignore")

    PROJECT_NAME: str = "Example app"
    API_V1_STR: str = "/api/v1"
    FRONTEND_HOST: str = "http://localhost:5173"
    BACKEND_CORS_ORIGINS: Annotated[list[str], NoDecode, BeforeValidator(parse_cors)] = []
    # One URL for the app and for cronlock (which reads DATABASE_URL too), e.g.
    # postgresql://app@127.0.0.1:6432/app through PgBouncer in transaction mode.
    DATABASE_URL: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def all_cors_origins(self) -> list[str]:
        return [origin.rstrip("/") for origin in self.BACKEND_CORS_ORIGINS] + [self.FRONTEND_HOST]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def SQLALCHEMY_DATABASE_URI(self) -> str:
        for scheme in ("postgres://", "postgresql://"):
            if self.DATABASE_URL.startswith(scheme):
                return self.DATABASE_URL.replace(scheme, "postgresql+asyncpg://", 1)
        return self.DATABASE_URL


settings = Settings()
