"""The app's SQLModel models: users and items as in the template, and the two tables its
scheduled jobs write (a report per day, a digest per user and day)."""

import uuid
from datetime import UTC, datetime

from sqlalchemy import DateTime
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


# --- users ----------------------------------------------------------------------------------


class UserBase(SQLModel):
    email: str = Field(unique=True, index=True, max_length=255)
    full_name: str | None = Field(default=None, max_length=255)
    digest_enabled: bool = True


class UserCreate(UserBase):
    pass


class User(UserBase, table=True):
    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    # The day of the last digest this user got: what makes the digest job idempotent.
    last_digest_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class UserPublic(UserBase):
    id: uuid.UUID
    last_digest_at: datetime | None


class UsersPublic(SQLModel):
    data: list[UserPublic]
    count: int


# --- items ----------------------------------------------------------------------------------


class ItemBase(SQLModel):
    title: str = Field(min_length=1, max_length=255)
    description: str | None = Field(default=None, max_length=255)


class ItemCreate(ItemBase):
    owner_id: uuid.UUID


class ItemUpdate(SQLModel):
    title: str | None = Field(default=None, min_length=1, max_length=255)
    description: str | None = Field(default=None, max_length=255)


class Item(ItemBase, table=True):
    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    owner_id: uuid.UUID = Field(foreign_key="user.id", nullable=False, ondelete="CASCADE")
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True))


class ItemPublic(ItemBase):
    id: uuid.UUID
    owner_id: uuid.UUID
    created_at: datetime


class ItemsPublic(SQLModel):
    data: list[ItemPublic]
    count: int


class Message(SQLModel):
    message: str


# --- what the scheduled jobs write ----------------------------------------------------------


class DailyReport(SQLModel, table=True):
    __tablename__ = "daily_report"

    id: int | None = Field(default=None, primary_key=True)
    # The schedule slot the report is for (cronlock's ctx.slot).
    day: datetime = Field(sa_type=DateTime(timezone=True), index=True)
    users: int
    items: int
    # cronlock's run that wrote it (its ledger row).
    run_id: int


class Digest(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    user_id: uuid.UUID = Field(foreign_key="user.id", nullable=False, ondelete="CASCADE")
    day: datetime = Field(sa_type=DateTime(timezone=True), index=True)
    run_id: int
